"""benchmarks/gpu_session.sh: the stages a session with a lent GPU runs. Without a GPU only its
bookkeeping can be checked: a stage whose budget is spent skips every step and says so in the
log under $OUT; a step that fails is logged with its exit status and the stage goes on to the
next, which runs (stage 3: the profile needs CUDA, the host's phases do not); an unknown stage
is refused."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_session.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("stage", ["1", "2", "3"])
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
