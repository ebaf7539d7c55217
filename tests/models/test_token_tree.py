"""Token trees (`speculative_token_tree`): Medusa's candidates verified as a tree in one step.

Shown on the tree itself (parsed breadth first, cut as a prefix, over random trees); on one
step (each tree row's hidden state is the one a plain decode of its branch gives, on the module
path, the native CPU call and the torch reference's decode mask); end to end: HF's greedy
tokens with random heads under chunked prompts and preemption, every node the heads' ranked
candidate by the formula over HF's hidden state; and with an oracle that hides the right token
behind a wrong top guess at every depth, so that only branches off the first are kept (their
K/V and hidden states moved to the positions they take): the tokens of decoding one at a time
for greedy, seeded sampled, penalised, constrained and grammar-bound requests, with every
guess of the right branch taken.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams, StructuredOutputParams
from conveyor.config import ConfigError, SchedulerConfig
from conveyor.core.speculative import TokenTree
from conveyor.models import llama
from conveyor.models.attention import TorchPagedAttention, build_metadata, chain_decodes
from conveyor.runner.medusa import MedusaDrafter
from tests.conftest import build_tiny_model
from tests.models import test_eagle
from tests.models.test_eagle import SHORT, VOCAB
from tests.models.test_medusa import reference_candidates, write_heads
from tests.models.test_moe import hf_greedy

target = test_eagle.target
CPU = torch.device("cpu")
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0)]
# The oracle's tree: the right token is always the second guess, so the kept branch is rows
# 2, 4, 6 (depths 1, 2, 3), never where a chain would have put it.
SECOND = [(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]


# -- the tree ------------------------------------------------------------------------------
def test_a_tree_is_kept_breadth_first_with_its_rows_parents_and_children():
    tree = TokenTree.parse("[(1, 0), (0,), (0, 0), (1,), (0, 0, 3), (0, 0, 0), (0, 0, 1), (0, 0, 2)]")
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3))
    assert tree.parents == (-1, 0, 0, 1, 2, 3, 3, 3, 3)
    assert tree.depths == (0, 1, 1, 2, 2, 3, 3, 3, 3)
    assert tree.children[0] == (1, 2) and tree.children[3] == (5, 6, 7, 8) and tree.children[4] == ()
    assert tree.branch(8) == [1, 3, 8] and tree.branch(0) == []
    assert [tree.width(d) for d in (1, 2, 3)] == [2, 1, 4]
    assert tree.cut(2, 99) == 4 and tree.cut(9, 3) == 3 and tree.cut(0, 9) == 0
    assert not tree.is_chain and TokenTree.parse([[0], [0, 0]]).is_chain


@pytest.mark.parametrize("bad, match", [
    ("[(0,), (0, 0", "not a list of tuples"),
    ([], "non-empty list"),
    ([(0,), ()], "not a path"),
    ([(0,), (-1,)], "not a path"),
    ([(0,), (0,)], "twice"),
    ([(0,), (1, 0)], "no parent"),
])
def test_a_malformed_tree_is_refused_by_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        TokenTree.parse(bad)


@st.composite
def trees(draw) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, 14))):
        parent = draw(st.sampled_from([(), *paths]))
        if len(parent) < 5:
            child = (*parent, draw(st.integers(0, 3)))
            if child not in paths:
                paths.append(child)
    return [p for p in paths if all(p[:i] in paths for i in range(1, len(p)))] or [(0,)]


@settings(max_examples=60, deadline=None)
@given(trees(), st.randoms(use_true_random=False), st.integers(0, 6), st.integers(0, 16))
def test_any_tree_in_any_order_parses_to_rows_whose_branches_are_its_paths(paths, rng, max_depth, max_nodes):
    shuffled = list(paths)
    rng.shuffle(shuffled)
    tree = TokenTree.parse(shuffled)
    assert sorted(tree.paths) == sorted(paths)
    for k in range(1, len(tree.depths)):
        assert 0 <= tree.parents[k] < k and tree.depths[k] == tree.depths[tree.parents[k]] + 1
        assert k in tree.children[tree.parents[k]]
        assert tuple(tree.paths[r - 1][-1] for r in tree.branch(k)) == tree.paths[k - 1]
    n = tree.cut(max_depth, max_nodes)
    assert n <= max_nodes and all(d <= max_depth for d in tree.depths[: n + 1])
    assert n == tree.num_nodes or n == max_nodes or tree.depths[n + 1] > max_depth  # the longest prefix


def test_the_option_is_checked_and_sets_the_node_count():
    config = SchedulerConfig(speculative_method="medusa", speculative_token_tree=TREE)
    assert config.num_speculative_tokens == len(TREE) and TokenTree.parse(config.speculative_token_tree).depth == 4
    with pytest.raises(ConfigError, match="node count"):
        SchedulerConfig(speculative_method="medusa", speculative_token_tree=TREE, num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="drafts branch only with"):
        SchedulerConfig(speculative_method="draft_model", speculative_token_tree=TREE)
    with pytest.raises(ConfigError, match="no parent"):
        SchedulerConfig(speculative_method="medusa", speculative_token_tree="[(0,), (0, 1, 0)]")
    with pytest.raises(ConfigError, match="apply only with a speculative_method"):
        SchedulerConfig(speculative_token_tree=TREE)


# -- one step --------------------------------------------------------------------------------
def linear_reference(model, ids, table, start, tree, k, caches, bs):
    """Row k of a tree span as a plain decode: the root and row k's branch at consecutive
    positions after the context, on a copy of the caches (a fresh table tail past start)."""
    rows = [0, *tree.branch(k)]
    caches = copy.deepcopy(caches)
    meta = build_metadata([table], [start], [len(rows)], bs, CPU)
    with torch.inference_mode():
        hidden = model(ids[rows], meta.positions, caches, meta)
    return hidden[-1]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_each_tree_row_sees_its_branch_on_every_path(tiny_models, kv_dtype):
    """A step of a decode, a tree span and a chain: the native call over chained tree rows, the
    module path over them (the native attention with `decode_paths`), the torch reference's
    decode mask, and the spans as prefills under the tree's mask all give each tree row the
    hidden state of a plain decode of its branch, and write each row's K/V to its own slot."""
    from conveyor.kernels import decode_layers

    model = LLM(str(tiny_models["llama"]), dtype="float32", num_kv_blocks=16).engine.runner.model
    arch, bs = model.arch, 4
    tree = TokenTree.parse(TREE)
    g = torch.Generator().manual_seed(5)
    starts, num_new = [9, 13, 6], [1, 1 + tree.num_nodes, 4]
    trees = [None, tree, None]
    perm = torch.randperm(36, generator=g).tolist()
    tables = [perm[0:6], perm[6:12], perm[12:18]]
    caches = [torch.randn(2, 36 * bs, arch.num_kv_heads, arch.head_dim, generator=g).to(kv_dtype)
              for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (sum(num_new),), generator=g)
    chained = chain_decodes(tables, starts, num_new, bs, CPU, None, torch.float32, trees)
    spans = build_metadata(tables, starts, num_new, bs, CPU, None, torch.float32, trees)
    assert chained.positions.tolist()[1 : 1 + num_new[1]] == [13 + d for d in tree.depths]
    assert spans.positions.tolist() == chained.positions.tolist()
    assert spans.slot_mapping.tolist() == chained.slot_mapping.tolist()
    fused = model.fused_decode
    results = {}
    native = decode_layers() is not None and isinstance(fused, llama.FusedDecode)
    for name in ("native", "modules", "reference", "spans"):
        if name == "native" and not native:
            continue
        c = copy.deepcopy(caches)
        meta = spans if name == "spans" else chained
        model.fused_decode = fused if name == "native" else None
        backends = [layer.self_attn.backend for layer in model.layers]
        if name == "reference":
            for layer in model.layers:
                layer.self_attn.backend = TorchPagedAttention()
        try:
            with torch.inference_mode():
                results[name] = (model(ids, meta.positions, c, meta), c)
        finally:
            model.fused_decode = fused
            for layer, b in zip(model.layers, backends, strict=True):
                layer.self_attn.backend = b
    near = 1e-4 if kv_dtype == torch.float32 else 5e-3
    a = 1  # the tree span's first row
    for k in range(1 + tree.num_nodes):
        want = linear_reference(model, ids[a : a + 1 + tree.num_nodes], tables[1], 13, tree, k, caches, bs)
        for name, (hidden, _) in results.items():
            torch.testing.assert_close(hidden[a + k], want, rtol=near, atol=near, msg=f"{name} row {k}")
    ref_hidden, ref_caches = results["spans"]
    for name, (hidden, c) in results.items():
        torch.testing.assert_close(hidden, ref_hidden, rtol=near, atol=near, msg=name)
        for x, y in zip(c, ref_caches, strict=True):
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-3, atol=1e-3)


# -- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_heads(tmp_path_factory.mktemp("tree") / "heads", seed=1)


def tree_llm(model: Path, heads: Path, tree=TREE, **options) -> LLM:
    return LLM(str(model), speculative_method="medusa", speculative_model=str(heads),
               speculative_token_tree=str(tree), **{"dtype": "float64", "num_kv_blocks": 64, "block_size": 8, **options})


def record(drafter: MedusaDrafter, oracle: dict[tuple[int, ...], list[int]] | None = None):
    """Every round's `(tokens up to the step's input, its input included; the drafter's guesses;
    the tree's nodes)`, recorded from now on.
    With `oracle` (each prompt's expected output), the guesses are then replaced: at every depth
    the second candidate of the branch of second candidates is the right token, every other
    node a wrong one."""
    rounds: list[tuple[list[int], list[int], tuple]] = []
    fill = drafter.fill

    def recorded(out):
        fill(out)
        for it in out.scheduled:
            if not it.num_draft:
                continue
            rounds.append((list(it.all_token_ids[: it.start_pos + 1]), list(it.token_ids[1:]),
                           it.tree.paths[: it.num_draft]))
            if oracle is None:
                continue
            right = oracle[tuple(it.all_token_ids[: it.prompt_len])][it.start_pos + 1 - it.prompt_len :]
            for k, path in enumerate(it.tree.paths[: it.num_draft], 1):
                token = right[len(path) - 1] if len(path) <= len(right) else 3
                it.token_ids[k] = token if all(r == 1 for r in path) else (token + 1) % VOCAB

    drafter.fill = recorded  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16, "block_size": 4},
    {"num_kv_blocks": 14, "block_size": 4},
    {"num_kv_blocks": 14, "block_size": 4, "preemption_mode": "swap", "num_swap_blocks": 64},
], ids=["default", "chunked", "preempt", "swap"])
def test_greedy_tokens_are_the_models_and_nodes_the_heads_ranked_candidates(target, head, options):
    llm = tree_llm(target, head, **options)
    rounds = record(llm.engine.drafter)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(target, SHORT, 16)
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0  # (random heads: guesses rarely right; the oracle's test keeps them)
    if options.get("num_kv_blocks") == 14:
        assert sched.num_preemptions > 0
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    tree = TokenTree.parse(TREE)
    for tokens, guesses, paths in rounds[:: max(1, len(rounds) // 8)]:
        ranked = reference_candidates(target, head, tokens[:-1], [tree.width(d) for d in range(1, tree.depth + 1)])
        assert guesses == [ranked[len(p) - 1][p[-1]] for p in paths]


@pytest.mark.parametrize("dtype, options", [
    ("float64", {}),
    ("float64", {"num_kv_blocks": 14, "block_size": 4}),
    ("float32", {"max_num_seqs": 1}),  # the native call, batch 1
    ("float32", {}),  # the native call, the batch
], ids=["f64", "f64-preempt", "native-b1", "native"])
def test_branches_off_the_first_are_kept_and_moved_into_place(target, head, dtype, options):
    """The right token always the second candidate: every kept guess is off the first branch,
    so every later token reads K/V (and the heads a hidden state) that were moved to their
    positions. The tokens are decoding's; the right branch is taken whole; the heads' own
    guesses, read from the moved states, are the formula's."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype=dtype, **{"num_kv_blocks": 64, "block_size": 8, **options})
    want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
    llm = tree_llm(target, head, SECOND, dtype=dtype, **options)
    rounds = record(llm.engine.drafter, {tuple(p): w for p, w in zip(SHORT, want, strict=True)})
    got = [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)]
    assert got == want
    sched = llm.engine.scheduler
    # Every round keeps its right branch: as deep as the tree allows, but the last.
    assert sched.num_accepted_tokens >= 3 * (len(rounds) - 2 * len(SHORT)) > 0
    if dtype == "float64":
        tree = TokenTree.parse(SECOND)
        for tokens, guesses, paths in rounds[:: max(1, len(rounds) // 8)]:
            ranked = reference_candidates(target, head, tokens[:-1], [tree.width(d) for d in range(1, 4)])
            assert guesses == [ranked[len(p) - 1][p[-1]] for p in paths]


def test_seeded_sampling_keeps_its_tokens_down_any_branch(target, head):
    """Rows at one depth share a row of noise and the kept branch draws one a position: the
    oracle's branch (the plain run's sampled tokens) is taken, and the tokens are the plain
    run's, penalties and min_tokens applied along each row's own branch."""
    rng = random.Random(3)
    params = [SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=rng.randrange(99), ignore_eos=i % 2 == 0,
                             repetition_penalty=1.0 + 0.2 * (i % 3), presence_penalty=0.3 * (i % 2), min_tokens=5)
              for i in range(len(SHORT))]
    plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
    llm = tree_llm(target, head, SECOND)
    record(llm.engine.drafter, {tuple(p): w for p, w in zip(SHORT, want, strict=True)})
    assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want
    assert llm.engine.scheduler.num_accepted_tokens > 2 * len(SHORT)


def test_grammars_and_bad_words_follow_each_rows_branch(tiny_models, tmp_path):
    """Regex-bound and bad_words requests (a model with a tokenizer): each row's grammar state
    and banned words are those after its own branch, so the oracle's branch is allowed exactly
    where decoding allowed it, and the tokens are decoding's."""
    from transformers import AutoTokenizer

    from tests.structured.tiny_tokenizer import with_tokenizer
    from tests.test_structured_outputs import PATTERNS, PROMPTS

    model = with_tokenizer(tiny_models["llama"], tmp_path / "llama")
    heads = write_heads(tmp_path / "heads", seed=2)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(p) for p in PROMPTS[: len(PATTERNS)]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputParams(regex=p))
              for p in PATTERNS]
    params += [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, bad_words=["the", "cat dog"])]
    prompts += [tok.encode("the cat")]
    plain = LLM(str(model), dtype="float64", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = tree_llm(model, heads, SECOND)
    record(llm.engine.drafter, {tuple(p): w for p, w in zip(prompts, want, strict=True)})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.scheduler.num_accepted_tokens > len(prompts)


def test_what_a_tree_needs_is_checked(target, head, tmp_path):
    with pytest.raises(ConfigError, match="reaches depth 5: the Medusa checkpoint has 4 heads"):
        tree_llm(target, head, [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)])
    windowed = build_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=5, hidden_size=64, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="sliding-window"):
        tree_llm(windowed, head)
    # A tree of top guesses only is a chain: verified as one.
    llm = tree_llm(target, head, [(0,), (0, 0)])
    assert llm.engine.scheduler.token_tree is None and llm.engine.config.scheduler.num_speculative_tokens == 2


def test_each_rows_controls_follow_its_branch(target):
    """A tree row's penalty history, min_tokens and bad_words are those after its own branch,
    not after the rows before it: on one verification step's rows of the second-guess tree."""
    from conveyor.core.scheduler import ScheduledSequence
    from conveyor.sequence import PLACEHOLDER

    runner = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8).engine.runner
    runner.word_token_ids = lambda words: [(21, 23, 40), (50,)]  # (a word of three tokens, one of one)
    tree = TokenTree.parse(SECOND)  # rows 1 (0,), 2 (1,), 3 (1, 0), 4 (1, 1), 5 (1, 1, 0), 6 (1, 1, 1)
    params = SamplingParams(max_tokens=9, temperature=0.0, min_tokens=4, stop_token_ids=[30], repetition_penalty=1.2,
                            bad_words=["x"])
    tokens = [5, 6, 7, 8, 9, PLACEHOLDER]  # a prompt of 3, outputs 8 and 9, the step's input 9 at position 4
    it = ScheduledSequence(1, [9, 20, 21, 22, 23, 24, 25], 4, [0, 1], True, params, tokens, 3, 6, tree=tree)
    rows = [it] * 7
    histories = runner._histories(rows)
    assert histories == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 20], [5, 6, 7, 8, 9, 21], [5, 6, 7, 8, 9, 21, 22],
                         [5, 6, 7, 8, 9, 21, 23], [5, 6, 7, 8, 9, 21, 23, 24], [5, 6, 7, 8, 9, 21, 23, 25]]
    allowed, _, _ = runner._constraints(rows)
    # Output index 2 + depth: the stop token held back below 4, at depths 0 and 1 (rows 0-2).
    assert allowed[:, 30].tolist() == [False, False, False, True, True, True, True]
    assert not allowed[:, 50].any()
    # (21, 23) ends only row 4's branch: its 40 is banned there alone.
    assert allowed[:, 40].tolist() == [True, True, True, True, False, True, True]


# -- EAGLE heads: a drafting step a depth ---------------------------------------------------
EAGLE_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]
RANK_ONE = [(1,), (1, 0), (1, 0, 0)]  # the (1,) (1, 0) (1, 0, 0) branch alone


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle_tree")
    return {"eagle": test_eagle.write_head(root / "eagle1", "eagle", seed=1),
            "eagle3": test_eagle.write_head(root / "eagle3", "eagle3", seed=3, draft_vocab=96)}


def eagle_tree_llm(target: Path, heads: dict[str, Path], method: str, tree=EAGLE_TREE, **options) -> LLM:
    spec = {"speculative_token_tree": str(tree)} if tree is not None else {"num_speculative_tokens": 3}
    return LLM(str(target), speculative_method=method, speculative_model=str(heads[method]),
               **{"dtype": "float64", "num_kv_blocks": 64, "block_size": 8, **spec, **options})


def first_rounds(llm: LLM, prompts, params) -> dict[tuple[int, ...], list[int]]:
    """Each round's guesses by its context (the tokens up to the step's input), and the tokens."""
    rounds: dict[tuple[int, ...], list[int]] = {}
    drafter = llm.engine.drafter
    fill = drafter.fill

    def recorded(out):
        fill(out)
        for it in out.scheduled:
            if it.num_draft:
                rounds.setdefault(tuple(it.all_token_ids[: it.start_pos + 1]), list(it.token_ids[1:]))

    drafter.fill = recorded  # type: ignore[method-assign]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return rounds, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_an_eagle_heads_tree_ranks_each_nodes_children_after_its_own_branch(target, eagle_heads, method, dtype):
    """Every node's children are the head's ranked guesses after that node's branch alone: the
    tree's top-guess branch is what the head drafts as a chain, and its (1,) (1, 0) (1, 0, 0)
    branch what a tree of that branch alone drafts, round by round where the contexts meet; the
    tokens are HF's greedy ones (in float32 the head's attention takes the native kernel's
    branch paths)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tree_rounds, got = first_rounds(eagle_tree_llm(target, eagle_heads, method, dtype=dtype), SHORT, params)
    chain_rounds, chain = first_rounds(eagle_tree_llm(target, eagle_heads, method, None, dtype=dtype), SHORT, params)
    alone_rounds, alone = first_rounds(eagle_tree_llm(target, eagle_heads, method, RANK_ONE, dtype=dtype), SHORT,
                                       params)
    if dtype == "float64":
        assert got == chain == alone == hf_greedy(target, SHORT, 16)
    else:
        assert got == chain == alone
    rows = {p: k for k, p in enumerate(TokenTree.parse(EAGLE_TREE).paths)}
    met = 0
    for context, nodes in tree_rounds.items():
        if len(nodes) < len(EAGLE_TREE):
            continue  # (cut near max_tokens)
        if context in chain_rounds and len(chain_rounds[context]) == 3:
            assert [nodes[rows[p]] for p in [(0,), (0, 0), (0, 0, 0)]] == chain_rounds[context]
            met += 1
        if context in alone_rounds and len(alone_rounds[context]) == 3:
            assert [nodes[rows[p]] for p in RANK_ONE] == alone_rounds[context]
            met += 1
    assert met >= 2 * len(SHORT)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_heads_kept_branches_off_the_first_feed_it_again(target, eagle_heads, method):
    """The oracle's second-candidate branch kept every round: the target's moved states feed
    the head's next round (EAGLE-3's three streams too), and the tokens are decoding's,
    greedy and seeded."""
    for params in (SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)):
        plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
        want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
        llm = eagle_tree_llm(target, eagle_heads, method, SECOND)
        rounds = record(llm.engine.drafter, {tuple(p): w for p, w in zip(SHORT, want, strict=True)})
        assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want
        assert llm.engine.scheduler.num_accepted_tokens >= 3 * (len(rounds) - 2 * len(SHORT)) > 0
        assert llm.engine.drafter.store.num_missing == 0
        if params.temperature == 0:
            # The head's own guesses (before the oracle's) after moved branches are those of a
            # run that kept no branch off the first and reached each context a token a step.
            plain_rounds, _ = first_rounds(eagle_tree_llm(target, eagle_heads, method, SECOND), SHORT, params)
            met = [(plain_rounds[c], g) for context, g, _ in rounds if (c := tuple(context)) in plain_rounds]
            assert len(met) >= len(rounds) // 2 and all(a == b for a, b in met)
