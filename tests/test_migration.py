"""Live migration (Llumnix's, stop-and-copy): a running request taken out of one engine
(`Engine.migrate_out`) goes on in another (`migrate_in`) with the K/V of what it computed.

On the tiny Llama in float64, a greedy request migrated after a few steps ends with the tokens
of a request never moved, having computed on the second engine only what followed; the first
engine frees its blocks and emits nothing for it; requests that cannot move are left alone.
"""

from __future__ import annotations

import pytest

from conveyor import EngineConfig, SamplingParams
from conveyor.engine import Engine
from tests.conftest import finish_all as finish

PROMPT = list(range(10, 47))  # 37 tokens


def engine(model: str, **kw: object) -> Engine:
    return Engine.from_config(EngineConfig.from_kwargs(model=model, dtype="float64", num_kv_blocks=64, block_size=8,
                                                       **kw))


@pytest.mark.parametrize("options", [{"kv_receive_space": 1 << 22}, {}], ids=["received", "no-receive-space"])
def test_a_migrated_request_ends_as_one_never_moved(tiny_models, options):
    model = str(tiny_models["llama"])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = engine(model)
    alone.add_request("r", PROMPT, params)
    want = finish(alone)["r"]

    a, b = engine(model), engine(model, **options)
    a.add_request("r", PROMPT, params)
    a.add_request("other", [5, 6, 7], params)
    for _ in range(6):  # the prompt, then a few decodes
        assert not [o for o in a.step() if o.request_id == "r" and o.finished]
    m = a.migrate_out("r")
    assert m is not None and len(m.resume.output_token_ids) == 6
    assert a.scheduler.block_manager.num_used_blocks == 1  # only "other"'s block is left
    b.migrate_in(m)
    got_b = finish(b)
    assert "r" not in finish(a)  # nothing more of it from the first engine
    assert got_b["r"] == want
    if not options:  # no room to receive the K/V: computed again there
        assert m.handoff is not None and b.num_kv_recomputed == 1
    else:
        assert m.handoff is not None and m.handoff.num_tokens == len(PROMPT) + 5 and b.num_kv_received == 1
    assert a.num_migrated_out == b.num_migrated_in == 1


def test_a_seeded_request_draws_on_where_it_stood(tiny_models):
    """A sampled request with a seed: the second engine's generator starts from the seed and
    skips the draws of the tokens made before the move, so the request ends as one never moved."""
    model = str(tiny_models["llama"])
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine(model)
    alone.add_request("r", PROMPT, params)
    want = finish(alone)["r"]
    a, b = engine(model), engine(model, kv_receive_space=1 << 22)
    a.add_request("r", PROMPT, params)
    for _ in range(6):
        a.step()
    m = a.migrate_out("r")
    assert m is not None
    b.migrate_in(m)
    assert finish(b)["r"] == want


def test_requests_that_cannot_move_are_left_alone(tiny_models):
    e = engine(str(tiny_models["llama"]))
    e.add_request("new", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    assert e.migrate_out("new") is None  # nothing generated yet
    assert e.migrate_out("missing") is None
    e.add_request("two", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, n=2))
    e.step()
    e.step()
    assert e.migrate_out("two") is None  # n choices go together
    assert set(finish(e)) == {"new", "two"}
