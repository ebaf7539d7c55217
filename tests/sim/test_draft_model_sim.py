"""Speculative decoding with a draft model in the simulator: the engine's real drafter runs the
draft's steps on a second cost model, and every number here can be followed by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.cli import main
from conveyor.config import ConfigError, EngineConfig
from conveyor.replay import TimedRequest, replay
from conveyor.sampling_params import SamplingParams
from conveyor.sim.engine import build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

DRAFT = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.fixture
def draft_path(tmp_path):
    path = tmp_path / "draft" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(DRAFT))
    return str(path.parent)


def engine(draft_path, rate, **kw):
    config = EngineConfig.from_kwargs(speculative_method="draft_model", speculative_model=draft_path,
                                      gpu_memory_utilization=0.5, **kw)
    return build_sim_engine(config, TOY_HW, TOY, TOY_PARAMS, acceptance_rate=rate)


def test_the_draft_shares_the_kv_budget_and_its_weights_count(draft_path):
    draft = get_model(draft_path)
    assert draft.kv_bytes_per_token(2) == 1 * 2 * 1 * 16 * 2 == 64  # one layer, K and V, one head of 16
    eng = engine(draft_path, 1.0)
    # 4 GiB x 0.5 - 1 GiB - the weights of both; a block holds 16 tokens of both models' K/V.
    budget = 2 * 2**30 - 2**30 - TOY.weight_bytes(2) - draft.weight_bytes(2)
    assert eng.num_kv_blocks == budget // (16 * (256 + 64))
    cap = describe_capacity(eng)
    assert cap["kv_bytes_per_token"] == 320
    assert cap["weight_gib"] == (TOY.weight_bytes(2) + draft.weight_bytes(2)) / 2**30


def test_one_request_by_hand(draft_path):
    """Prompt 32, 41 tokens, 4 guesses a round, all accepted: the prompt's step gives 1 token and
    8 rounds give 5 each. The draft is fed the 33 known tokens and 3 guesses in round 1, then
    the last guess, the model's token and 3 guesses in each of 7 more: 71 tokens, 32 steps."""
    eng = engine(draft_path, 1.0, num_speculative_tokens=4)
    replay(eng, [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=41, ignore_eos=True))])
    drafter = eng.drafter
    assert drafter is not None
    assert eng.scheduler.num_draft_tokens == eng.scheduler.num_accepted_tokens == 32
    assert drafter.runner.num_steps == 32  # type: ignore[attr-defined]
    assert drafter.num_fed_tokens == 33 + 3 + 7 * (2 + 3)
    assert len(eng.step_trace) == 9
    # The clock moved by the target's steps and the draft's, nothing else.
    assert eng.clock.now == pytest.approx(eng.runner_busy_s)
    assert eng.runner_busy_s > eng.runner.busy_s > 0  # type: ignore[attr-defined]


def test_guesses_pay_only_when_accepted():
    """Llama-3.1-8B on an H100 at batch 1 with Llama-3.2-1B drafting: all accepted is faster
    than one token a step, none accepted slower (the draft's steps cost, nothing is kept)."""
    def duration(rate=None, **kw):
        config = EngineConfig.from_kwargs(**kw)
        eng = build_sim_engine(config, get_hardware("h100-sxm"), get_model("llama-3.1-8b"), acceptance_rate=rate)
        replay(eng, [TimedRequest(0.0, [5] * 256, SamplingParams(max_tokens=128, ignore_eos=True))])
        return eng.clock.now

    base = duration()
    spec = {"speculative_method": "draft_model", "speculative_model": "llama-3.2-1b"}
    assert duration(1.0, **spec) < 0.6 * base
    assert duration(0.0, **spec) > base


def test_bad_drafts_are_refused(draft_path):
    hw, model = get_hardware("h100-sxm"), get_model("llama-2-7b")
    with pytest.raises(ConfigError, match="needs a speculative_model"):
        build_sim_engine(EngineConfig.from_kwargs(speculative_method="draft_model"), hw, model, acceptance_rate=0.5)
    config = EngineConfig.from_kwargs(speculative_method="draft_model", speculative_model="llama-3.2-1b")
    with pytest.raises(ConfigError, match="vocabulary"):  # Llama 2's 32,000 tokens against Llama 3's
        build_sim_engine(config, hw, model, acceptance_rate=0.5)
    config = EngineConfig.from_kwargs(speculative_method="draft_model", speculative_model="no-such-model")
    with pytest.raises(ConfigError, match="unknown model"):
        build_sim_engine(config, hw, model, acceptance_rate=0.5)


def test_simulate_command_with_a_draft_model(tmp_path):
    out = tmp_path / "out"
    assert main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "4",
                 "--concurrency", "2", "--input-len", "128", "--output-len", "64", "--no-plots", "--no-progress",
                 "--speculative-method", "draft_model", "--speculative-model", "llama-3.2-1b",
                 "--spec-acceptance-rate", "0.8", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["systems"][0]["points"][0]["summary"]["completed"] == 4
    assert result["engine_options"]["speculative_model"] == "llama-3.2-1b"
    tree = tmp_path / "tree"
    assert main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "4",
                 "--concurrency", "2", "--input-len", "128", "--output-len", "64", "--no-plots", "--no-progress",
                 "--speculative-method", "medusa", "--speculative-token-tree", "[(0,), (1,), (0, 0)]",
                 "--spec-acceptance-rate", "0.6", "--spec-rank-acceptance", "0.2", "--out", str(tree)]) == 0
    result = json.loads((tree / "result.json").read_text())
    assert result["systems"][0]["points"][0]["summary"]["completed"] == 4


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_is_priced_as_a_one_layer_draft(method):
    """`speculative_method="eagle"` / `"eagle3"`: the head's steps priced on one dense layer of the
    model's width with its own head (EAGLE-3's over 32,000 draft tokens), its weights and one
    layer's K/V in the memory plan; every guess taken at an acceptance of 1; refused over latent
    attention."""
    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    base = build_sim_engine(EngineConfig.from_kwargs(), hw, model)
    engine = build_sim_engine(EngineConfig.from_kwargs(speculative_method=method, num_speculative_tokens=3),
                              hw, model, acceptance_rate=1.0)
    draft = engine.drafter.runner.cost_model.model
    assert (draft.num_layers, draft.hidden_size) == (1, model.hidden_size)
    assert draft.vocab_size == (32000 if method == "eagle3" else model.vocab_size)
    assert describe_capacity(engine)["kv_bytes_per_token"] == model.kv_bytes_per_token(2) * 33 // 32
    assert describe_capacity(engine)["weight_gib"] > describe_capacity(base)["weight_gib"]
    requests = [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=16, ignore_eos=True)) for _ in range(4)]
    replay(engine, requests)
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens == scheduler.num_draft_tokens
    with pytest.raises(ConfigError, match="latent attention"):
        build_sim_engine(EngineConfig.from_kwargs(speculative_method=method), get_hardware("h200"),
                         get_model("deepseek-v3"), acceptance_rate=0.8)


def test_medusa_heads_are_priced_as_one_pass_over_their_weights():
    """`speculative_method="medusa"`: `num_speculative_tokens` heads of one block and an LM head
    each, their weights in the memory plan, a round priced as one pass over them (an LM head of
    that many rows) for the drafting rows; every guess taken at an acceptance of 1; cheaper a
    round than an EAGLE head, so faster at one request with the same acceptance."""
    from conveyor.sim.engine import MedusaSimDrafter, medusa_params

    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    base = build_sim_engine(EngineConfig.from_kwargs(), hw, model)
    engine = build_sim_engine(EngineConfig.from_kwargs(speculative_method="medusa", num_speculative_tokens=3),
                              hw, model, acceptance_rate=1.0)
    drafter = engine.drafter
    assert isinstance(drafter, MedusaSimDrafter)
    h = model.hidden_size
    assert medusa_params(engine.config, model) == 3 * (h * h + h + model.vocab_size * h)
    grown = describe_capacity(engine)["weight_gib"] - describe_capacity(base)["weight_gib"]
    assert grown == pytest.approx(medusa_params(engine.config, model) * 2 / 2**30)
    assert describe_capacity(engine)["kv_bytes_per_token"] == describe_capacity(base)["kv_bytes_per_token"]
    requests = [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=16, ignore_eos=True)) for _ in range(4)]
    replay(engine, requests)
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens == scheduler.num_draft_tokens
    assert drafter.cost.model.vocab_size * h == medusa_params(engine.config, model)
    overhead = drafter.cost.params.step_overhead_s
    assert drafter.busy_s > 0 and drafter.last_duration_s in (
        0.0, *(drafter.cost.head_time(n) + overhead for n in range(1, 5)))

    def one_request(method: str) -> float:
        eng = build_sim_engine(EngineConfig.from_kwargs(speculative_method=method, num_speculative_tokens=3),
                               hw, model, acceptance_rate=0.7, seed=3)
        replay(eng, [TimedRequest(0.0, [5] * 64, SamplingParams(max_tokens=128, ignore_eos=True))])
        return eng.clock()

    assert one_request("medusa") < one_request("eagle")


SECOND = "[(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]"  # the second candidate's branch: rows 2, 4, 6
T9 = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]"


def assert_a_tree_beats_its_chain_at_one_request(method: str, **tree: Any) -> None:
    """On an H100 at one request, where a row costs little, a tree of 9 (`tree`: its options;
    T9 by default) whose lower ranks are right sometimes serves faster than the chain of its
    depth."""
    def clock(config: EngineConfig, **rates: Any) -> float:
        eng = build_sim_engine(config, get_hardware("h100-sxm"), get_model("llama-3.1-8b"), seed=3, **rates)
        replay(eng, [TimedRequest(0.0, [5] * 64, SamplingParams(max_tokens=256, ignore_eos=True))])
        return eng.clock()

    wide = EngineConfig.from_kwargs(speculative_method=method, **(tree or {"speculative_token_tree": T9}))
    chain = EngineConfig.from_kwargs(speculative_method=method, num_speculative_tokens=3)
    assert clock(wide, acceptance_rate=0.6, rank_acceptance=(0.15, 0.05)) < clock(chain, acceptance_rate=0.6)


def test_a_token_tree_is_walked_by_the_rates_of_its_ranks():
    """At each depth the model's token is the rank-r candidate with that rank's rate (or none),
    and the walk goes on while the tree has that child among the nodes the step holds."""
    from conveyor.core.speculative import TokenTree
    from conveyor.sim.engine import SimRunner

    second, pair = TokenTree.parse(SECOND), TokenTree.parse("[(0,), (1,)]")
    assert SimRunner(None, acceptance_rate=0.0, rank_acceptance=(1.0,))._walk(second, 6) == 3  # type: ignore[arg-type]
    # the first 3 nodes hold (1,) but not (1, 1): one token
    assert SimRunner(None, acceptance_rate=0.0, rank_acceptance=(1.0,))._walk(second, 3) == 1  # type: ignore[arg-type]
    assert SimRunner(None, acceptance_rate=1.0, rank_acceptance=(0.0,))._walk(second, 6) == 1  # type: ignore[arg-type]
    # (a rank past the rates given is never the model's token)
    assert SimRunner(None, acceptance_rate=0.0, rank_acceptance=(0.0,))._walk(TokenTree.parse("[(2,)]"), 1) == 0  # type: ignore[arg-type]
    runner = SimRunner(None, acceptance_rate=0.5, rank_acceptance=(0.3,), seed=4)  # type: ignore[arg-type]
    kept = [runner._walk(pair, 2) for _ in range(20_000)]
    assert abs(sum(kept) / len(kept) - 0.8) < 0.015  # the top candidate or the second, 0.5 + 0.3


def test_medusa_token_trees_are_priced_as_their_rows_and_refused_without_ranks():
    """A tree of Medusa candidates: its depth's heads in the weights; every round keeps the
    branch the rates choose (the second candidate's, all of it, where only it is right); and on
    an H100 at one request, where a row costs little, a tree whose lower ranks are right
    sometimes beats the chain of its depth."""
    from conveyor.sim.engine import medusa_params

    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    tree = EngineConfig.from_kwargs(speculative_method="medusa", speculative_token_tree=SECOND)
    h = model.hidden_size
    assert medusa_params(tree, model) == 3 * (h * h + h + model.vocab_size * h)
    engine = build_sim_engine(tree, hw, model, acceptance_rate=0.0, rank_acceptance=(1.0,))
    replay(engine, [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=41, ignore_eos=True))])
    sched = engine.scheduler
    assert sched.num_draft_tokens == 6 * 10 and sched.num_accepted_tokens == 3 * 10  # 1 + 10 rounds of 4 tokens
    assert_a_tree_beats_its_chain_at_one_request("medusa")
    chain = EngineConfig.from_kwargs(speculative_method="medusa", num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="--spec-rank-acceptance"):
        build_sim_engine(tree, hw, model, acceptance_rate=0.7)
    with pytest.raises(ConfigError, match="apply to a speculative_token_tree"):
        build_sim_engine(chain, hw, model, acceptance_rate=0.7, rank_acceptance=(0.1,))
    with pytest.raises(ConfigError, match="at most 1 in all"):
        build_sim_engine(tree, hw, model, acceptance_rate=0.7, rank_acceptance=(0.2, 0.2))


def test_an_eagle_heads_token_tree_is_priced_a_step_a_depth():
    """An EAGLE head's tree in the simulator: the round's first step, then one head step a depth
    with a row for each node that has children (for the second candidate's branch: 1, then 1,
    then none, so 3 steps a round as a chain of 3 takes, with one row each); the rates walk it
    as Medusa's; at one request a tree whose lower ranks are right sometimes beats the chain."""
    from conveyor.sim.engine import TreeSimDrafter

    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    tree = EngineConfig.from_kwargs(speculative_method="eagle3", speculative_token_tree=SECOND)
    engine = build_sim_engine(tree, hw, model, acceptance_rate=0.0, rank_acceptance=(1.0,))
    assert isinstance(engine.drafter, TreeSimDrafter)
    steps = head_steps(engine)
    sched = engine.scheduler
    assert sched.num_draft_tokens == 6 * 10 and sched.num_accepted_tokens == 3 * 10
    assert len(steps) == 3 * 10 and all(s == [1] for s in steps[1::3]) and all(s == [1] for s in steps[2::3])
    assert_a_tree_beats_its_chain_at_one_request("eagle3")


def head_steps(engine: Any) -> list[list[int]]:
    """One request of 40 tokens after its first through `engine`: each head step's rows."""
    steps = []
    execute = engine.drafter.runner.execute

    def counted(out):
        steps.append([len(it.token_ids) for it in out.scheduled])
        return execute(out)

    engine.drafter.runner.execute = counted
    replay(engine, [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=41, ignore_eos=True))])
    return steps


def test_an_eagle2_tree_is_the_shape_its_rates_grow_and_priced_as_expanded():
    """`speculative_eagle_topk` in the simulator: each round's tree is the one EAGLE-2's rule grows
    when the head's confidence in a rank is that rank's rate (the second candidate always right:
    its branch all kept, three guesses a round), priced as the drafter runs it: the round's first
    step, then a head step a depth with the nodes expanded there as rows (topk 2: two a depth);
    and at one request a dynamic tree whose lower ranks are right sometimes beats the chain."""
    from conveyor.sim.engine import TreeSimDrafter

    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    config = EngineConfig.from_kwargs(speculative_method="eagle3", speculative_eagle_topk=2, speculative_num_steps=3,
                                      num_speculative_tokens=6)
    engine = build_sim_engine(config, hw, model, acceptance_rate=0.0, rank_acceptance=(1.0,))
    assert isinstance(engine.drafter, TreeSimDrafter)
    steps = head_steps(engine)
    sched = engine.scheduler
    assert sched.num_draft_tokens == 6 * 10 and sched.num_accepted_tokens == 3 * 10
    assert len(steps) == 3 * 10 and all(s == [1, 1] for s in steps[1::3]) and all(s == [1, 1] for s in steps[2::3])
    with pytest.raises(ConfigError, match="speculative_eagle_topk: the simulator needs"):
        build_sim_engine(config, hw, model, acceptance_rate=0.7)

    assert_a_tree_beats_its_chain_at_one_request("eagle3", speculative_eagle_topk=3, speculative_num_steps=3,
                                                 num_speculative_tokens=9)


def test_a_draft_budget_shares_a_steps_drafts_among_its_sequences():
    """`speculative_draft_budget`: a step's drafts never exceed the budget, each sequence's its
    even share of it (a tree's first nodes, a chain's first guesses), so drafts narrow as the
    batch grows: a tree of 9 nodes drafts whole at 2 sequences, 2 nodes each at 16 (and more as
    they finish)."""
    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    for method, options in (("medusa", {"speculative_token_tree": T9}), ("ngram", {"num_speculative_tokens": 4})):
        config = EngineConfig.from_kwargs(speculative_method=method, speculative_draft_budget=32, **options)
        rates = {"rank_acceptance": (0.1,)} if method == "medusa" else {}
        for concurrency, widest in ((2, 9 if method == "medusa" else 4), (16, 2)):
            engine = build_sim_engine(config, hw, model, acceptance_rate=0.5, **rates)
            seen: list[tuple[int, list[int]]] = []
            schedule = engine.scheduler.schedule

            def recorded(*args, schedule=schedule, engine=engine, seen=seen, **kwargs):
                out = schedule(*args, **kwargs)
                seen.append((len(engine.scheduler.running), [it.num_draft for it in out.scheduled]))
                return out

            engine.scheduler.schedule = recorded
            replay(engine, [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=48, ignore_eos=True))
                            for _ in range(concurrency)])
            assert all(sum(d) <= 32 and max(d, default=0) <= 32 // max(1, running) for running, d in seen)
            assert max(max(d, default=0) for running, d in seen if running == concurrency) == widest
