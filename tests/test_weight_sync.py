"""New weights from a trainer (SGLang's weight-update API; conveyor/weight_sync.py).

On the tiny Llama (greedy): the tensors of another checkpoint, sent by their HF names, make the
engine answer as an engine built on that checkpoint; half of the old tensors, then the other
half, bring back the old answers (an update builds on the ones before it); a name or a shape the
model has not is refused and changes nothing; the tensors sent survive sleep level 2; the same
tensors broadcast over a gloo group the trainer and the engine join (in this process, and with
the engine in a process of its own) load as the ones handed over. Over HTTP:
tests/server/test_weight_sync_server.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import AsyncLLM, InvalidRequestError, SamplingParams
from conveyor.engine import Engine
from conveyor.models.loader import iter_hf_tensors
from conveyor.weight_sync import (
    WeightBroadcaster,
    deserialize_named_tensors,
    serialize_named_tensors,
    weight_metadata,
)
from tests.conftest import build_tiny_model
from tests.conftest import finish_all as finish
from tests.test_pause import engine

PROMPT = list(range(10, 30))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def answer(e: Engine) -> list[int]:
    e.add_request("q", PROMPT, GREEDY)
    return finish(e)["q"]


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], list[int]]:
    """Another seed's weights of the tiny Llama's configuration: its path, tensors and greedy answer."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # (tests/conftest.py's `tiny_models["llama"]`)
    path = build_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", seed=11, rope_scaling=rope,
                            rope_theta=10000.0)
    return path, dict(iter_hf_tensors(path)), answer(engine(str(path)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("way", ["in place", "built again"])
def test_tensors_sent_answer_as_their_checkpoint_and_updates_build_on_each_other(tiny_models, other, way,
                                                                                monkeypatch):
    """In place (CPU's native layout) and built again from the checkpoint with the tensors sent
    so far (CUDA's way, here forced)."""
    from conveyor.models import loader
    from conveyor.models.llama import TransposedLinear

    _, theirs, want_theirs = other
    e = engine(str(tiny_models["llama"]))
    model = e.runner.model  # type: ignore[attr-defined]
    if way == "built again":
        monkeypatch.setattr(loader, "update_weights_in_place", lambda model, tensors, whole=False: False)
    elif any(isinstance(m, TransposedLinear) for m in model.modules()):
        pytest.skip("the native kernels are not built here: the projections are kept transposed")
    mine = answer(e)
    assert mine != want_theirs
    assert e.update_weights_from_tensor(theirs, weight_version="step-1") and e.get_weight_version() == "step-1"
    assert (e.runner.model is model) == (way == "in place")  # type: ignore[attr-defined]
    assert answer(e) == want_theirs
    own = dict(iter_hf_tensors(tiny_models["llama"]))
    names = sorted(own)
    e.update_weights_from_tensor([(n, own[n]) for n in names[: len(names) // 2]])
    halfway = answer(e)
    e.update_weights_from_tensor({n: own[n] for n in names[len(names) // 2:]})
    assert halfway not in (mine, want_theirs) and answer(e) == mine


def test_a_bad_name_or_shape_is_refused_and_changes_nothing(tiny_models, other):
    e = engine(str(tiny_models["llama"]))
    mine = answer(e)
    q = "model.layers.0.self_attn.q_proj.weight"
    for bad, match in (({"model.layers.0.self_attn.nope.weight": torch.zeros(4)}, "no parameter"),
                       ({q: torch.zeros(3, 3)}, "does not fit"),
                       ({q: other[1][q], "model.norm.weight": torch.zeros(3)}, "does not fit"),  # (one good)
                       ({}, "no tensors"),
                       ([("x", 1)], "pairs")):
        with pytest.raises(InvalidRequestError, match=match):
            e.update_weights_from_tensor(bad)
    assert answer(e) == mine and e._weight_overlay == {}
    e.add_request("busy", PROMPT, GREEDY)
    e.step()
    with pytest.raises(InvalidRequestError, match="idle or paused"):
        e.update_weights_from_tensor(other[1])
    finish(e)


def test_the_tensors_sent_survive_sleep_level_2_and_a_checkpoint_replaces_them(tiny_models, other):
    _, theirs, want_theirs = other
    e = engine(str(tiny_models["llama"]))
    mine = answer(e)
    e.update_weights_from_tensor(theirs)
    assert e.sleep(2) and e.wake_up()
    assert answer(e) == want_theirs
    e.update_weights_from_disk(str(tiny_models["llama"]))
    assert answer(e) == mine and e._weight_overlay == {}


def test_safetensors_text_round_trips_and_garbage_is_refused(other):
    _, theirs, _ = other
    back = deserialize_named_tensors(serialize_named_tensors(theirs))
    assert back.keys() == theirs.keys() and all(torch.equal(back[n], theirs[n]) for n in theirs)
    with pytest.raises(InvalidRequestError, match="safetensors"):
        deserialize_named_tensors("bm90IGEgZmlsZQ==")


def broadcast_in_thread(port: int, world_size: int, rounds: list[dict[str, torch.Tensor]],
                        bucket_bytes: list[int] | None = None) -> threading.Thread:
    """The trainer (rank 0): join, then send each round's tensors in turn (in buckets of
    `bucket_bytes[k]` for round k)."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            trainer = WeightBroadcaster("127.0.0.1", port, world_size, timeout_s=60)
            for k, tensors in enumerate(rounds):
                trainer.send(tensors, (bucket_bytes or [0] * len(rounds))[k])
            trainer.close()
        except BaseException as e:  # (seen by the test through `failures`)
            failures.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.failures = failures  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_tensors_broadcast_over_a_gloo_group_load_as_those_handed_over(tiny_models, other):
    _, theirs, want_theirs = other
    own = dict(iter_hf_tensors(tiny_models["llama"]))
    e = engine(str(tiny_models["llama"]))
    mine = answer(e)
    port = free_port()
    trainer = broadcast_in_thread(port, 2, [theirs, own], bucket_bytes=[0, 20_000])
    assert e.init_weights_update_group("127.0.0.1", port, 1, 2, timeout_s=60)
    with pytest.raises(InvalidRequestError, match="already"):
        e.init_weights_update_group("127.0.0.1", port, 1, 2)
    with pytest.raises(InvalidRequestError, match="items"):  # refused before anything is received
        e.update_weights_from_distributed(["a"], ["float32"], [])
    with pytest.raises(InvalidRequestError, match="torch dtype"):
        e.update_weights_from_distributed(["a"], ["float99"], [[2]])
    assert e.update_weights_from_distributed(*weight_metadata(theirs), weight_version="v2")
    assert answer(e) == want_theirs and e.get_weight_version() == "v2"
    assert e.update_weights_from_distributed(*weight_metadata(own), bucket_bytes=20_000)  # (packed, as sent)
    trainer.join(60)
    assert not trainer.is_alive() and trainer.failures == []  # type: ignore[attr-defined]
    assert answer(e) == mine
    assert e.destroy_weights_update_group()
    with pytest.raises(InvalidRequestError, match="no such"):
        e.update_weights_from_distributed(*weight_metadata(theirs))


def test_async_llm_with_an_engine_process_takes_tensors_and_joins_a_group(tiny_models, other):
    _, theirs, want_theirs = other
    own = dict(iter_hf_tensors(tiny_models["llama"]))
    port = free_port()

    async def main() -> tuple[Any, ...]:
        llm = AsyncLLM(str(tiny_models["llama"]), num_kv_blocks=64, block_size=8, engine_process=True)

        async def ask() -> list[int]:
            outs = [o async for o in llm.generate(PROMPT, GREEDY, f"r{len(seen)}")]
            seen.append(1)
            return list(outs[-1].outputs[0].token_ids)

        seen: list[int] = []
        try:
            mine = await ask()
            await llm.update_weights_from_tensor(theirs)
            after_tensors = await ask()
            trainer = broadcast_in_thread(port, 2, [own])
            await llm.init_weights_update_group("127.0.0.1", port, 1, 2)
            await llm.update_weights_from_distributed(*weight_metadata(own), weight_version="back")
            await asyncio.to_thread(trainer.join, 60)
            return mine, after_tensors, await ask(), await llm.get_weight_version(), trainer.failures  # type: ignore[attr-defined]
        finally:
            await llm.shutdown()

    mine, after_tensors, after_broadcast, version, failures = asyncio.run(main())
    assert after_tensors == want_theirs and after_broadcast == mine and version == "back" and failures == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
                          st.lists(st.integers(0, 40), max_size=3)), max_size=20),
       st.integers(0, 4000))
def test_a_bucket_plan_keeps_the_order_one_dtype_a_bucket_and_near_its_size(tensors, bucket_bytes):
    from conveyor.weight_sync import bucket_plan

    dtypes, shapes = [d for d, _ in tensors], [s for _, s in tensors]
    plan = bucket_plan(dtypes, shapes, bucket_bytes)
    assert [i for bucket in plan for i in bucket] == list(range(len(tensors)))
    nbytes = [d.itemsize * int(torch.Size(s).numel()) for d, s in tensors]
    for bucket in plan:
        assert len({dtypes[i] for i in bucket}) == 1
        assert bucket_bytes > 0 or len(bucket) == 1
        assert sum(nbytes[i] for i in bucket[:-1]) < max(bucket_bytes, 1)  # (it closes once full)


@pytest.mark.parametrize("options", [
    {"dtype": "float64"},  # no native kernels: projections kept transposed, written through a view
    {"dtype": "float64", "tensor_parallel_size": 2, "num_threads": 1},  # each rank its slice
    {"speculative_method": "ngram"},
    # the draft (the first checkpoint) left as it is: the target's checks keep the answer its own
    {"speculative_method": "draft_model", "speculative_model": "<tiny>", "num_speculative_tokens": 3},
    {"enable_lora": True, "max_loras": 2},  # the adapters' wrapped projections
    {"quantization": "int8"},  # built again and quantized again (same calibration)
], ids=["float64", "tensor-parallel", "ngram", "draft-model", "lora", "int8"])
def test_every_kind_of_engine_answers_as_one_built_on_the_new_weights(tiny_models, other, options):
    """Tensors sent, then the engine's own checkpoint loaded from disk again (of the same
    configuration: in place where the model fits), against engines built on each."""
    from conveyor import LLM

    path, theirs, _ = other

    def ask(llm: LLM) -> list[int]:
        return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)

    kw = {"num_kv_blocks": 64, "block_size": 8,
          **{k: str(tiny_models["llama"]) if v == "<tiny>" else v for k, v in options.items()}}
    want = ask(LLM(str(path), **kw))
    llm = LLM(str(tiny_models["llama"]), **kw)
    mine = ask(llm)
    assert llm.update_weights_from_tensor(theirs)
    assert ask(llm) == want != mine
    assert llm.update_weights_from_disk(str(tiny_models["llama"]))
    assert ask(llm) == mine


def test_a_checkpoint_of_the_same_configuration_loads_in_place_and_a_short_one_is_refused(tiny_models, other,
                                                                                           tmp_path):
    import shutil

    from safetensors.torch import save_file

    path, theirs, want_theirs = other
    e = engine(str(tiny_models["llama"]))
    model = e.runner.model  # type: ignore[attr-defined]
    e.update_weights_from_disk(str(path))
    assert e.runner.model is model and answer(e) == want_theirs and e.model_path == str(path)  # type: ignore[attr-defined]
    short = tmp_path / "short"
    short.mkdir()
    shutil.copy(path / "config.json", short / "config.json")
    save_file({n: t.contiguous() for n, t in theirs.items() if n != "model.norm.weight"}, str(short / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="lacks"):
        e.update_weights_from_disk(str(short))
    assert answer(e) == want_theirs and e.model_path == str(path)
