"""Speculative decoding in the scheduler (no torch): the n-gram proposer against a brute-force
search, and random request streams whose decodes verify drafts, with the fake runner that
samples after every draft (tests/core/helpers.py). Outputs must equal what each request
generates alone, with every block accounted for after every step."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, EngineConfig, SchedulerConfig
from conveyor.core.speculative import NgramProposer, Proposer, TokenTree, register_proposer
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import Sequence
from tests.core.helpers import VOCAB, Driver, next_token
from tests.core.test_scheduler import Scenario, check_outputs, run_scenario, scenarios


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=8), 0.0)


def ngram(min_n: int = 2, max_n: int = 4) -> NgramProposer:
    return NgramProposer(SchedulerConfig(speculative_method="ngram", prompt_lookup_min=min_n, prompt_lookup_max=max_n))


# -- the n-gram proposer -------------------------------------------------------------------
def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The specification: the longest suffix (max_n down to min_n) with an earlier occurrence;
    from its latest one, the tokens that followed, going on with the period it implies."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for s in range(L - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                ext = list(tokens)
                period = L - (s + n)
                for _ in range(k):
                    ext.append(ext[len(ext) - period])
                return ext[L:]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=0, max_size=40)
    | st.lists(st.sampled_from([0, 1, 256, 65536, 2**24, 2**31 - 1]), max_size=30),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
)
def test_ngram_proposes_what_followed_the_latest_longest_match(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    """Also with ids whose bytes could match across a token boundary (0, 256, 65536, ...)."""
    proposer = ngram(min_n, min_n + extra)
    seq = seq_of(tokens)
    want = brute_force(tokens, min_n, min_n + extra, k)
    assert proposer.propose(seq, k) == want
    event("proposes" if want else "nothing")
    # Grown in place: the same as a fresh proposer on the longer sequence.
    seq.token_ids.extend([3, 1, 3])
    assert proposer.propose(seq, k) == brute_force(seq.token_ids, min_n, min_n + extra, k)


def test_ngram_examples() -> None:
    p = ngram(2, 3)
    assert p.propose(seq_of([5, 6, 7, 8, 9, 5, 6], 0), 3) == [7, 8, 9]  # what followed "5 6"
    assert p.propose(seq_of([1, 2, 1, 2], 1), 5) == [1, 2, 1, 2, 1]  # periodic: goes on repeating
    assert p.propose(seq_of([1, 2, 3, 4], 2), 3) == []  # no suffix seen before
    # The longest match wins over a later shorter one.
    assert p.propose(seq_of([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], 3), 1) == [9]
    assert ngram(2, 2).propose(seq_of([7, 1, 2, 9, 3, 1, 2, 8, 7, 1, 2], 4), 1) == [8]


def brute_force_tree(tokens: list[int], min_n: int, max_n: int, tree: TokenTree, count: int) -> list[int]:
    """The tree's specification: the latest 8 occurrences of the longest suffix seen before, each
    continued as `brute_force` continues one; node k's candidates are the tokens, at its depth,
    of the continuations whose earlier tokens are its branch's, by how many hold each (then the
    latest first); a rank past them takes the latest continuation's token."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        starts = [s + n for s in range(L - n - 1, -1, -1) if tokens[s : s + n] == suffix][:8]
        if not starts:
            continue
        depth = tree.depths[count]
        conts = []
        for start in starts:
            ext, period = list(tokens), L - start
            for _ in range(depth):
                ext.append(ext[len(ext) - period])
            conts.append(ext[L:])
        out: list[int] = []
        for k in range(1, count + 1):
            branch = [out[r - 1] for r in tree.branch(k)[:-1]]  # the tokens before this node on its branch
            path = tree.paths[k - 1]
            # (a branch through a node the matches did not reach reaches no match)
            valid = all(len({c[i] for c in conts if c[:i] == branch[:i]}) > p for i, p in enumerate(path[:-1]))
            here = [c for c in conts if c[: len(branch)] == branch] if valid else []
            firsts: list[int] = []
            for c in here:
                if c[len(branch)] not in firsts:
                    firsts.append(c[len(branch)])
            ranked = sorted(firsts, key=lambda t: -sum(c[len(branch)] == t for c in here))
            out.append(ranked[path[-1]] if path[-1] < len(ranked) else conts[0][len(path) - 1])
        return out
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    min_n=st.integers(1, 2),
    paths=st.sampled_from([
        [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
        [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (1, 1, 0)],
        [(1,), (1, 0), (1, 0, 0)],
    ]),
    count=st.integers(1, 8),
)
def test_ngram_trees_rank_the_latest_matches_continuations(tokens, min_n, paths, count) -> None:
    tree = TokenTree.parse(paths)
    count = min(count, tree.num_nodes)
    proposer = ngram(min_n, min_n + 2)
    proposer.tree = tree
    assert proposer.propose(seq_of(tokens), count) == brute_force_tree(tokens, min_n, min_n + 2, tree, count)


def test_ngram_tree_examples() -> None:
    p = ngram(2, 2)
    p.tree = TokenTree.parse([(0,), (1,), (2,), (0, 0), (1, 0)])
    # "1 2" was followed by 7 twice and by 8 once (the latest first among equals): 7, 8, then
    # nothing for rank 2 (the latest match's 8); after 7, what followed "1 2 7": 5, then 9.
    tokens = [1, 2, 7, 9, 1, 2, 8, 6, 1, 2, 7, 5, 1, 2]
    assert p.propose(seq_of(tokens), 5) == [7, 8, 7, 5, 6]


# -- a proposer that is right as often as the test wants ------------------------------------
@register_proposer("test-oracle")
class OracleProposer(Proposer):
    """Proposes the model's true continuation (the fake model is a known function), wrong from
    a pseudo-random position on, or entirely wrong: every acceptance length happens."""

    def num_right(self, seq: Sequence, max_tokens: int) -> int:
        return hash((seq.seq_id, len(seq.token_ids))) % (max_tokens + 2)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = list(seq.token_ids)
        right = self.num_right(seq, max_tokens)
        out = []
        for i in range(max_tokens):
            t = next_token(tokens)
            out.append(t if i < right else (t + 1) % VOCAB)
            tokens.append(out[-1])
        return out


@register_proposer("test-wrong")
class WrongProposer(OracleProposer):
    """Drafts the model never accepts."""

    def num_right(self, seq: Sequence, max_tokens: int) -> int:
        return 0


@register_proposer("test-right")
class RightProposer(OracleProposer):
    """Drafts the model always accepts."""

    def num_right(self, seq: Sequence, max_tokens: int) -> int:
        return max_tokens


@st.composite
def speculative_scenarios(draw: st.DrawFn, chunked: bool) -> Scenario:
    sc = draw(scenarios(chunked))
    method = draw(st.sampled_from(["test-oracle", "ngram", "test-wrong", "test-right"]))
    config = dataclasses.replace(
        sc.config,
        speculative_method=method,
        num_speculative_tokens=draw(st.integers(1, 6)),
        prompt_lookup_min=1 if method == "ngram" else 2,  # a 16-token vocabulary: short matches abound
        speculative_disable_by_batch_size=draw(st.none() | st.integers(1, 8)),
        speculative_draft_cost=draw(st.sampled_from([0.0, 0.0, 0.3])),
    )
    return dataclasses.replace(sc, config=config)


SPECULATIVE_STREAMS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_speculative_stream(sc: Scenario) -> None:
    result = run_scenario(sc)
    check_outputs(result, sc.max_model_len)
    event("preempted" if result.num_preemptions else "no preemption")


@SPECULATIVE_STREAMS
@given(speculative_scenarios(chunked=True))
def test_speculative_random_streams_with_chunked_prefill(sc: Scenario) -> None:
    check_speculative_stream(sc)


@SPECULATIVE_STREAMS
@given(speculative_scenarios(chunked=False))
def test_speculative_random_streams_without_chunked_prefill(sc: Scenario) -> None:
    check_speculative_stream(sc)


# -- the scheduler's choices ----------------------------------------------------------------
def test_a_decode_verifies_drafts_and_keeps_the_accepted_ones() -> None:
    d = Driver(64, 4, max_num_batched_tokens=64, speculative_method="test-oracle", num_speculative_tokens=4)
    seq = d.add(0, prompt_len=5, max_tokens=40)
    d.run()
    d.check_outputs()
    assert d.sched.num_draft_tokens > 0
    assert 0 < d.sched.num_accepted_tokens < d.sched.num_draft_tokens
    # Fewer steps than tokens: a prefill step, then under one step a token.
    assert len(d.log) < 1 + len(seq.output_token_ids)
    assert d.bm.num_free_blocks == 64


def test_drafts_fit_max_tokens_and_the_step_budget() -> None:
    d = Driver(64, 4, max_num_batched_tokens=3, speculative_method="test-oracle", num_speculative_tokens=6)
    d.add(0, prompt_len=3, max_tokens=5)
    d.run()
    d.check_outputs()
    assert all(out.num_tokens <= 3 for out in d.log)
    assert max(item.num_draft for out in d.log for item in out.scheduled) == 2  # budget 3: 1 + 2


def test_drafts_stop_when_the_batch_is_large() -> None:
    d = Driver(64, 4, speculative_method="test-oracle", speculative_disable_by_batch_size=2)
    d.add(0, prompt_len=3, max_tokens=12)
    d.add(1, prompt_len=3, max_tokens=3)
    d.run()
    d.check_outputs()
    drafted = [len(out.scheduled) for out in d.log if out.num_draft_tokens]
    assert drafted and set(drafted) == {1}  # only once request 1 has finished


def test_drafts_never_take_the_watermark_or_preempt() -> None:
    """With every block but the sequence's own taken, it decodes on without drafts, and
    nobody is preempted for a draft."""
    d = Driver(4, 4, speculative_method="test-oracle", num_speculative_tokens=4)
    d.add(0, prompt_len=5, max_tokens=10)  # 2 blocks, then 3
    d.add(1, prompt_len=5, max_tokens=1)
    d.run()
    d.check_outputs()
    assert d.sched.num_preemptions == 0


def test_speculative_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="async_scheduling"):
        SchedulerConfig(speculative_method="ngram", async_scheduling=True)
    with pytest.raises(ConfigError, match="speculative_method"):
        SchedulerConfig(num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="not one of"):
        SchedulerConfig(speculative_method="lookahead")
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SchedulerConfig(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SchedulerConfig(speculative_method="ngram", num_speculative_tokens=0)
    assert EngineConfig.from_kwargs(speculative_method="ngram", num_speculative_tokens=2).scheduler.num_speculative_tokens == 2


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_cached_blocks_hold_only_verified_kv(block_size: int) -> None:
    """A block registered in the prefix cache holds the K/V of its tokens in every slot: never
    a rejected draft's, nor a slot the step left unwritten (the token sampled last)."""
    d = Driver(64, block_size, prefix_caching=True, speculative_method="test-oracle", num_speculative_tokens=5)
    for i in range(3):
        d.add(i, prompt_len=4 + i, max_tokens=30, prompt=[1, 2, 3, 4, 5, 6][: 4 + i])
    checked = 0
    while d.sched.has_unfinished():
        d.step()
        for seq in d.sched.running:
            key = 0
            for pos, token in enumerate(seq.token_ids):
                key = hash((key, token))
                block = seq.block_table[pos // block_size] if pos // block_size < len(seq.block_table) else None
                if block is not None and d.bm._block_hash[block] is not None:
                    assert d.runner.slots[block * block_size + pos % block_size] == (key, pos), (seq, pos)
                    checked += 1
    d.check_outputs()
    assert checked and d.sched.num_accepted_tokens


def test_adaptive_drafting_follows_each_requests_acceptance() -> None:
    """With a draft cost, a request whose drafts are all rejected soon stops drafting (each
    rejection lowers its estimate: 1/2, 1/3, 1/4 ... below the cost), and one whose drafts are
    all accepted drafts the most it may."""
    wrong = Driver(64, 4, speculative_method="test-wrong", num_speculative_tokens=4, speculative_draft_cost=0.3)
    wrong.add(0, prompt_len=3, max_tokens=30)
    wrong.run()
    wrong.check_outputs()
    drafts = [out.num_draft_tokens for out in wrong.log[1:]]
    assert drafts[:2] == [1, 1] and sum(drafts) == 2  # a = 1/2, 1/3: then 1/4 < 0.3

    right = Driver(64, 4, speculative_method="test-right", num_speculative_tokens=4, speculative_draft_cost=0.3)
    right.add(0, prompt_len=3, max_tokens=31)
    right.run()
    right.check_outputs()
    drafts = [out.num_draft_tokens for out in right.log[1:]]
    assert drafts[:5] == [1, 2, 4, 4, 4]  # a = 1/2: k=1; 2/3: k=2 ((2/3)^3 < 0.3); 4/5: k=4
    assert right.sched.num_accepted_tokens == right.sched.num_draft_tokens


def test_vllms_speculative_config_dict_sets_the_options() -> None:
    """`speculative_config` (vLLM's dict, or its JSON as `--speculative-config` takes it) sets
    the options its keys name; a key not read here, or one contradicting an option also given,
    is refused by name."""
    from conveyor.cli import build_parser, engine_kwargs
    from conveyor.config import EngineConfig

    c = EngineConfig.from_kwargs(speculative_config={"method": "eagle3", "model": "head/", "num_speculative_tokens": 3,
                                                     "disable_by_batch_size": 16})
    assert (c.scheduler.speculative_method, c.model.speculative_model, c.scheduler.num_speculative_tokens,
            c.scheduler.speculative_disable_by_batch_size) == ("eagle3", "head/", 3, 16)
    c = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "prompt_lookup_max": 5}',
                                 num_speculative_tokens=2)
    assert (c.scheduler.speculative_method, c.scheduler.prompt_lookup_max, c.scheduler.num_speculative_tokens) == (
        "ngram", 5, 2)
    with pytest.raises(ConfigError, match=r"\['draft_tensor_parallel_size'\] not read here"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1})
    with pytest.raises(ConfigError, match="speculative_method='mtp' is also given"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram"}, speculative_method="mtp")
    with pytest.raises(ConfigError, match="not JSON"):
        EngineConfig.from_kwargs(speculative_config="{method: ngram}")
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (c.scheduler.speculative_method, c.scheduler.num_speculative_tokens) == ("ngram", 2)
    # A token tree, as JSON's lists or vLLM's text; the node count set from it.
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "medusa", "model": "heads/", '
                                      '"speculative_token_tree": [[0], [1], [0, 0]]}'])
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (c.scheduler.speculative_token_tree, c.scheduler.num_speculative_tokens) == ("[(0,), (1,), (0, 0)]", 3)
    args = build_parser().parse_args(["serve", "--speculative-method", "medusa", "--speculative-model", "heads/",
                                      "--speculative-token-tree", "[(1,), (0,)]"])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).scheduler.speculative_token_tree == "[(0,), (1,)]"
