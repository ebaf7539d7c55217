"""EAGLE-2's dynamic trees (`speculative_eagle_topk`, `speculative_num_steps`): an EAGLE head
draws each step's token tree from its own confidence, and the step verifies it as a fixed tree.

Shown on the reranking alone (over random candidate sets: the best by score, closed under
parents, each row's path its ranks); on the drafter's expansion with a stand-in head whose
candidates are a function of the branch (over random languages, depths and cuts: the tree is
the one EAGLE-2's rule gives by brute force, and each expanded row attends to its own
branch's slots, inside the step's: checked there because a random head's guesses barely turn
on what its attention reads); and end to end with random heads: HF's greedy tokens,
every node the head's ranked candidate after its own branch (a full static tree's, where
contexts meet), trees cut by the step's budget and max_tokens, preemption, seeded sampling, and
an oracle that puts the right tokens on the deepest branch of each step's own tree.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError, SchedulerConfig
from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
from conveyor.core.speculative import DynamicTree, rerank
from conveyor.models.eagle import EagleHead
from conveyor.runner.drafter import GREEDY
from conveyor.runner.mtp import HiddenStore, MTPDrafter, _DraftOutput
from conveyor.sequence import PLACEHOLDER
from tests.conftest import build_tiny_model
from tests.models import test_eagle
from tests.models.test_eagle import SHORT, VOCAB
from tests.models.test_moe import hf_greedy

target = test_eagle.target


# -- the reranking ---------------------------------------------------------------------------


@st.composite
def candidate_sets(draw) -> tuple[list[tuple[int, int, float]], int]:
    """Candidates as a drafter makes them: each under the root or an earlier one, ranked after
    its siblings, scored its parent's plus a log probability (a few values, so scores tie)."""
    cands: list[tuple[int, int, float]] = []
    kids: dict[int, int] = {}
    for _ in range(draw(st.integers(1, 24))):
        parent = draw(st.integers(-1, len(cands) - 1))
        lp = draw(st.sampled_from([0.0, math.log(0.5), math.log(0.25), math.log(0.1)]))
        cands.append((parent, kids.get(parent, 0), (cands[parent][2] if parent >= 0 else 0.0) + lp))
        kids[parent] = kids.get(parent, 0) + 1
    return cands, draw(st.integers(1, len(cands)))


@settings(max_examples=150, deadline=None)
@given(candidate_sets())
def test_the_rerank_keeps_the_best_scored_as_a_tree_of_their_paths(case):
    cands, count = case
    tree, picked = rerank(cands, count)
    assert tree.num_nodes == len(picked) == len(set(picked)) == count
    left = set(range(len(cands))) - set(picked)
    assert all(cands[c][2] >= cands[d][2] for c in picked for d in left)  # the best
    row = {c: k for k, c in enumerate(picked, 1)}
    for k, c in enumerate(picked, 1):
        parent, rank, _ = cands[c]
        assert tree.parents[k] == (0 if parent < 0 else row[parent])  # closed: its parent kept
        assert tree.paths[k - 1][-1] == rank


# -- the drafter's expansion, with a stand-in head ---------------------------------------------


class BranchHead(EagleHead):
    """A head whose rows stand for (sequence, branch): row value i is `states[i]`, and a row's
    candidates are a fixed random distribution of that branch over `vocab` tokens."""

    feature_width = 1

    def __init__(self, vocab: int, seed: int) -> None:
        nn.Module.__init__(self)
        self.vocab, self.seed = vocab, seed
        self.states: list[tuple[int, tuple[int, ...]]] = []

    def state(self, seq_id: int, branch: tuple[int, ...]) -> torch.Tensor:
        self.states.append((seq_id, branch))
        return torch.tensor([[float(len(self.states) - 1)]])

    def dist(self, seq_id: int, branch: tuple[int, ...]) -> list[tuple[int, float]]:
        """Every token and its log probability, best first (then the lower id)."""
        rng = random.Random(hash((self.seed, seq_id, branch)))
        weights = [rng.choice([1, 1, 2, 3, 8]) for _ in range(self.vocab)]
        total = sum(weights)
        return sorted(((t, math.log(w / total)) for t, w in enumerate(weights)), key=lambda x: (-x[1], x[0]))

    def top_logprobs(self, hidden: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tops = [self.dist(*self.states[int(v)])[:width] for v in hidden[:, 0].tolist()]
        return (torch.tensor([[t for t, _ in top] for top in tops]),
                torch.tensor([[lp for _, lp in top] for top in tops], dtype=torch.float64))


class BranchRunner:
    """`execute_rows` of the stand-in head: each row's state is its parent's branch and its token;
    what each row was given is kept."""

    def __init__(self, head: BranchHead) -> None:
        self.layer = head
        self.rows: list[dict] = []

    def execute_rows(self, tables, positions, writes, paths, ids, previous):
        out = []
        for r, token in enumerate(ids):
            seq_id, branch = self.layer.states[int(previous[r, 0])]
            self.rows.append({"seq": seq_id, "branch": (*branch, token), "position": positions[r], "write": writes[r],
                              "path": list(paths[r])})
            out.append(self.layer.state(seq_id, (*branch, token)))
        return torch.cat(out)


def eagle2(dist, topk: int, depth: int, count: int) -> dict[tuple[int, ...], int]:
    """EAGLE-2's tree by brute force: rank paths -> tokens."""
    cands = []  # (branch tokens, rank path, score, depth)
    frontier = []
    for r, (t, lp) in enumerate(dist(())[:topk]):
        cands.append(((t,), (r,), lp, 1))
        frontier.append(len(cands) - 1)
    used = 0
    for _ in range(1, depth):
        best = sorted(frontier, key=lambda c: (-cands[c][2], c))[: min(topk, count + 1 - used)]
        if not best:
            break
        used += len(best)
        frontier = []
        for c in best:
            tokens, path, score, d = cands[c]
            for r, (t, lp) in enumerate(dist(tokens)[:topk]):
                cands.append(((*tokens, t), (*path, r), score + lp, d + 1))
                frontier.append(len(cands) - 1)
    kept = sorted(range(len(cands)), key=lambda c: (-cands[c][2], cands[c][3], c))[:count]
    return {cands[c][1]: cands[c][0][-1] for c in kept}


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.integers(4, 9), st.integers(0, 10**6),
       st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40)), min_size=1, max_size=3))
def test_the_drafter_grows_eagle2s_tree_and_each_row_reads_its_own_branch(topk, steps, vocab, seed, items):
    head = BranchHead(vocab, seed)
    runner = BranchRunner(head)
    drafter = MTPDrafter(runner, HiddenStore())  # type: ignore[arg-type]
    drafter.topk = topk
    shape = DynamicTree(topk, steps, 10**9)
    scheduled = []
    for seq_id, (depth, nodes) in enumerate(items):
        depth = min(depth, steps)
        nodes = min(nodes, shape.most_nodes(depth))
        start = 7 + seq_id
        scheduled.append(ScheduledSequence(seq_id, [5] + [PLACEHOLDER] * nodes, start, [seq_id], True, GREEDY,
                                           [5] * (start + 1), 3, nodes, tree_depth=depth))
    drafter._roots = lambda out, drafting: _DraftOutput(  # type: ignore[method-assign]
        {}, {it.seq_id: head.state(it.seq_id, ()) for it in drafting})
    drafter._fill_dynamic(SchedulerOutput(0, scheduled), scheduled)
    for it in scheduled:
        tree = it.tree
        assert tree is not None and tree.num_nodes == it.num_draft and tree.depth <= it.tree_depth
        want = eagle2(lambda b, s=it.seq_id: head.dist(s, b), topk, it.tree_depth, it.num_draft)
        assert {p: it.token_ids[k] for k, p in enumerate(tree.paths, 1)} == want
        rows = [r for r in runner.rows if r["seq"] == it.seq_id]
        base = it.start_pos - 1
        writes = [r["write"] for r in rows]
        assert len(set(writes)) == len(writes) and all(base < w <= base + it.num_draft + 1 for w in writes)
        at = {r["branch"]: r["write"] for r in rows}
        for r in rows:  # at its depth's position; its ancestors' slots, then its own
            assert r["position"] == base + len(r["branch"])
            assert r["path"] == [at[r["branch"][:d]] for d in range(1, len(r["branch"]) + 1)]


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.integers(1, 40),
       st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.6]), min_size=1, max_size=5))
def test_the_simulators_tree_is_the_one_its_rates_grow(topk, depth, count, rates):
    """`DynamicTree.expected` (the simulator's shape): EAGLE-2's tree by brute force when the
    rank-r candidate's probability is rates[r], and the rows it expands fit the step's slots."""
    count = min(count, DynamicTree(topk, depth, count).most_nodes(depth))
    tree, expanded = DynamicTree(topk, depth, count).expected(rates, depth, count)

    def dist(branch):
        return [(r, math.log(p) if p > 0 else -math.inf) for r, p in enumerate([*rates, *[0.0] * topk][:topk])]

    assert set(tree.paths) == set(eagle2(dist, topk, depth, count))
    assert sum(expanded) <= count + 1 and len(expanded) <= depth - 1 and all(e <= topk for e in expanded)


# -- end to end, random heads ------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dynamic_tree")
    return {"eagle": test_eagle.write_head(root / "eagle1", "eagle", seed=1),
            "eagle3": test_eagle.write_head(root / "eagle3", "eagle3", seed=3, draft_vocab=96)}


def dynamic_llm(target: Path, heads: dict[str, Path], method: str, topk=2, steps=3, nodes=6, **options) -> LLM:
    spec = ({"speculative_eagle_topk": topk, "speculative_num_steps": steps, "num_speculative_tokens": nodes}
            if topk else {})
    return LLM(str(target), speculative_method=method, speculative_model=str(heads[method]),
               **{"dtype": "float64", "num_kv_blocks": 64, "block_size": 8, **spec, **options})


def record(llm: LLM, oracle: dict[tuple[int, ...], list[int]] | None = None) -> list[tuple]:
    """Every round's `(context up to the step's input, its tokens by node path, num_draft,
    tree_depth, the last row's depth)`, the dynamic trees' scores checked. With `oracle`
    (each prompt's expected output) the guesses are then replaced: the deepest branch of the
    round's own tree (its last row's) holds the right tokens, every other node a wrong one."""
    rounds: list[tuple] = []
    drafter = llm.engine.drafter
    fill = drafter.fill

    def recorded(out):
        fill(out)
        for it in out.scheduled:
            if not it.num_draft:
                continue
            tree = it.tree
            if it.tree_depth:  # the nodes' scores: log confidences, a child's never above its parent's
                scores = [0.0, *drafter.scores[it.seq_id]]
                assert len(scores) == it.num_draft + 1 and all(
                    scores[k] <= scores[tree.parents[k]] for k in range(1, len(scores)))
            rounds.append((tuple(it.all_token_ids[: it.start_pos + 1]),
                           {p: it.token_ids[k] for k, p in enumerate(tree.paths[: it.num_draft], 1)}, it.num_draft,
                           it.tree_depth, tree.depths[it.num_draft]))
            if oracle is not None:
                right = oracle[tuple(it.all_token_ids[: it.prompt_len])][it.start_pos + 1 - it.prompt_len :]
                branch = tree.branch(tree.num_nodes)
                for k in range(1, tree.num_nodes + 1):
                    token = right[tree.depths[k] - 1]
                    it.token_ids[k] = token if k in branch else (token + 1) % VOCAB

    drafter.fill = recorded  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_nodes_are_the_heads_ranked_candidates_after_their_branch_and_tokens_hfs(target, heads, method, dtype):
    """The tokens are HF's greedy ones (in float32 the same as a static tree's, the head's
    attention through the native kernel's branch paths); each round's tree has its step's node
    count, the shapes differ from round to round, and every node is the candidate a full static
    tree of the same ranks holds at its path, where the two runs' contexts meet."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = dynamic_llm(target, heads, method, dtype=dtype)
    rounds = record(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)]
    full = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), *[(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]]
    static = LLM(str(target), speculative_method=method, speculative_model=str(heads[method]), dtype=dtype,
                 num_kv_blocks=64, block_size=8, speculative_token_tree=str(full))
    static_rounds = record(static)
    want = [o.outputs[0].token_ids for o in static.generate(SHORT, params, use_tqdm=False)]
    assert got == want
    if dtype == "float64":
        assert got == hf_greedy(target, SHORT, 16)
    assert all(len(nodes) == n for _, nodes, n, _, _ in rounds)
    assert len({tuple(nodes) for _, nodes, n, _, _ in rounds if n == 6}) > 1
    by_context = {c: nodes for c, nodes, n, d, _ in static_rounds if d == 0 and n == len(full)}
    met = 0
    for context, nodes, _, depth, _ in rounds:
        if context in by_context and depth == 3:
            assert all(by_context[context][p] == t for p, t in nodes.items())
            met += 1
    assert met >= len(SHORT)


def test_trees_are_cut_to_the_steps_budget_and_max_tokens_and_survive_preemption(target, heads):
    """A small token budget and max_tokens cut the trees (fewer nodes, shallower); recompute
    and swap preemption under a small KV cache; the tokens stay HF's."""
    prompts = [p * 3 for p in SHORT]
    want = hf_greedy(target, prompts, 24)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for options in ({"max_num_batched_tokens": 16, "max_num_seqs": 4},
                    {"num_kv_blocks": 22, "preemption_mode": "recompute"},
                    {"num_kv_blocks": 22, "preemption_mode": "swap", "num_swap_blocks": 64}):
        llm = dynamic_llm(target, heads, "eagle3", topk=3, steps=4, nodes=10, **options)
        rounds = record(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want, options
        assert all(tree_depth <= 4 and deepest <= tree_depth for *_, tree_depth, deepest in rounds)
        assert any(tree_depth < 4 for *_, tree_depth, _ in rounds)  # (near max_tokens)
        if "max_num_batched_tokens" in options:
            assert any(n < 10 for _, _, n, _, _ in rounds)
        else:
            assert llm.engine.scheduler.num_preemptions > 0, options


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_each_items_own_tree_is_walked_and_its_deepest_branch_kept(target, heads, method):
    """The oracle puts the right tokens on the deepest branch of each round's own tree (its
    last row's, rarely the top guesses'): every guess on it is accepted, for greedy and seeded
    sampled requests, and the tokens are decoding's one at a time."""
    for params in (SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True, repetition_penalty=1.3)):
        plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
        want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
        llm = dynamic_llm(target, heads, method, topk=3, steps=3, nodes=7)
        rounds = record(llm, {tuple(p): w for p, w in zip(SHORT, want, strict=True)})
        assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want
        assert llm.engine.scheduler.num_accepted_tokens == sum(deepest for *_, deepest in rounds)
        assert sum(any(list(nodes)[-1]) for _, nodes, *_ in rounds) > len(rounds) // 2  # off the top guesses
        assert llm.engine.drafter.store.num_missing == 0


def test_what_a_dynamic_tree_needs_is_checked(target, heads, tmp_path):
    config = SchedulerConfig(speculative_method="eagle3", speculative_eagle_topk=4, num_speculative_tokens=8)
    assert config.speculative_num_steps == 5
    for options, match in [
        ({"speculative_method": "medusa", "speculative_eagle_topk": 2}, "an EAGLE head's"),
        ({"speculative_method": "eagle", "speculative_eagle_topk": 1}, "at least 2"),
        ({"speculative_method": "eagle", "speculative_num_steps": 2}, "only with speculative_eagle_topk"),
        ({"speculative_method": "eagle", "speculative_eagle_topk": 2, "speculative_num_steps": 5,
          "num_speculative_tokens": 4}, "must be in"),
        ({"speculative_method": "eagle", "speculative_eagle_topk": 2, "speculative_num_steps": 2,
          "num_speculative_tokens": 7}, "at most 6 candidates"),
        ({"speculative_method": "eagle", "speculative_eagle_topk": 2, "speculative_token_tree": "[(0,), (1,)]"},
         "give one of them"),
        ({"speculative_eagle_topk": 2}, "apply only with a speculative_method"),
    ]:
        with pytest.raises(ConfigError, match=match):
            SchedulerConfig(**options)
    llm = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8, speculative_config={
        "method": "eagle3", "model": str(heads["eagle3"]), "speculative_eagle_topk": 2, "speculative_num_steps": 2,
        "num_speculative_tokens": 4})  # (SGLang's names in vLLM's dict)
    assert llm.engine.scheduler.dynamic_tree == DynamicTree(2, 2, 4)
    with pytest.raises(ConfigError, match="vocabulary has 96"):
        dynamic_llm(target, heads, "eagle3", topk=97, steps=1, nodes=4)
    windowed = build_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=5, hidden_size=64, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"speculative_eagle_topk: a token tree's rows .* sliding-window"):
        dynamic_llm(windowed, heads, "eagle")
    assert [DynamicTree(2, 3, 6).most_nodes(d) for d in range(4)] == [0, 2, 6, 10]
