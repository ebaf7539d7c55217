"""The hybrid KV cache (`hybrid_kv_cache=True`) on real models: Gemma 2, Gemma 3 (with two
sliding groups) and gpt-oss keep HF's greedy tokens under every scheduling while their sliding
layers read tables of their own whose blocks leave as the window moves on; with the same
memory, more long sequences run at once; what it is not built for is refused by name.

The block manager's side (release, swaps, prefix hits over every group) is property-tested
over random schedules in tests/core/test_switchboard.py and tests/core/test_hybrid_cache.py."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.core.block_manager import HybridLayout
from tests.conftest import build_tiny_model, triton_interpreted
from tests.models import test_gemma as gemma
from tests.models import test_gpt_oss as oss
from tests.models.test_moe import greedy_of

# Page counts for block_size 4: "preempt" holds about a third of what the six sequences want.
OPTIONS = [
    {},
    {"max_num_batched_tokens": 16, "block_size": 4},
    {"num_kv_blocks": 30, "block_size": 4},
    {"async_scheduling": True},
    {"speculative_method": "ngram", "prompt_lookup_min": 1},
    {"preemption_mode": "swap", "num_kv_blocks": 30, "block_size": 4, "num_swap_blocks": 200},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 32, "block_size": 4},
]
IDS = ["default", "chunked-16", "preempt", "async", "speculative", "swap", "prefix-hits"]
FAMILIES = ["gemma2", "gemma3", "gemma3-two-groups", "gpt_oss", "mistral-window"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "gemma2": build_tiny_model(root / "g2", "gemma2", seed=3, attn_logit_softcapping=0.2,
                                   final_logit_softcapping=1.0, **gemma.SHAPE),
        "gemma3": build_tiny_model(root / "g3", "gemma3", seed=4, sliding_window_pattern=2,
                                   rope_parameters=gemma.GEMMA3_ROPE, **gemma.SHAPE),
        # Six layers, a global one every third: two global, four sliding in two groups of two.
        "gemma3-two-groups": build_tiny_model(root / "g3b", "gemma3", seed=6, sliding_window_pattern=3,
                                              rope_parameters=gemma.GEMMA3_ROPE,
                                              **{**gemma.SHAPE, "num_hidden_layers": 6}),
        "gpt_oss": build_tiny_model(root / "oss", "gpt_oss", seed=3, **oss.SHAPE),
        # Every layer slides (Mistral-7B-v0.1's kind): the block table itself releases blocks.
        "mistral-window": build_tiny_model(root / "mistral", "mistral", seed=4, sliding_window=6),
    }


def reference(models: dict[str, object], family: str, prompts: list[list[int]], max_new: int,
              dtype: torch.dtype = torch.float64) -> list[list[int]]:
    if family == "gpt_oss":
        return greedy_of(oss.hf_model(models[family], dtype), prompts, max_new)
    return gemma.hf_greedy(models[family], prompts, max_new, dtype)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_the_layouts(models):
    layouts = {f: LLM(str(models[f]), dtype="float64", num_kv_blocks=16, hybrid_kv_cache=True)
               .engine.scheduler.block_manager.layout for f in FAMILIES}
    assert layouts == {"gemma2": HybridLayout(6, 2, 1), "gemma3": HybridLayout(6, 2, 1),
                       "gemma3-two-groups": HybridLayout(6, 2, 2), "gpt_oss": HybridLayout(6, 2, 1),
                       "mistral-window": HybridLayout(6, 3, 0, all_sliding=True)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_greedy_matches_transformers(models, family, options):
    """Every sequence outgrows the window of 6 (prompts up to 20 tokens, 16 new): sliding
    blocks are released while it decodes, swapped with it, taken again as a prefix hit."""
    prompts = gemma.LONG
    if "enable_prefix_caching" in options:  # three sharing a prefix of 3 blocks and more
        shared = gemma.LONG[0] + gemma.LONG[1] + gemma.LONG[2]
        prompts = [shared + p for p in gemma.LONG[3:]] + gemma.LONG
    if family == "mistral-window" and options.get("num_kv_blocks") == 30:
        # One sliding table: a sequence holds a window's and a chunk's pages, whatever its length.
        options = {**options, "num_kv_blocks": 12, "max_num_batched_tokens": 8}
    llm = LLM(str(models[family]), dtype="float64", hybrid_kv_cache=True,
              **{"num_kv_blocks": 64, "block_size": 8, **options})
    outs = llm.generate(prompts, gemma.PARAMS, use_tqdm=False)
    assert tokens(outs) == reference(models, family, prompts, 16)
    sched = llm.engine.scheduler
    bm = sched.block_manager
    assert bm.hybrid and bm.num_free_blocks == bm.num_blocks
    if options.get("num_kv_blocks") == 30:
        assert sched.num_preemptions > 0
    if "preemption_mode" in options:
        assert sched.num_swaps_out > 0
    if "enable_prefix_caching" in options:
        assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("family", ["gemma3-two-groups", "gpt_oss", "mistral-window"])
def test_float32_on_cpu_matches_transformers_float32(models, family):
    """The CPU's float32 path: the native decode kernel of each sliding layer reading its
    group's table, at batch 1 and in a batch of six."""
    expected = reference(models, family, gemma.LONG, 12, torch.float32)
    llm = LLM(str(models[family]), dtype="float32", num_kv_blocks=64, hybrid_kv_cache=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in gemma.LONG[:2]] == expected[:2]
    assert tokens(llm.generate(gemma.LONG, params, use_tqdm=False)) == expected


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreted(),
                    reason="the model on CPU tensors through Triton's interpreter (tests/kernels run the kernels on a GPU)")
def test_triton_backend_reads_each_groups_tables(models):
    model_dir = models["gemma3-two-groups"]
    prompts = gemma.LONG[:3]
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4, enforce_eager=True,
              hybrid_kv_cache=True)
    llm.engine.runner.model._use_triton_attention(torch.float32)  # on CUDA prepare_for_inference does it
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference(
        models, "gemma3-two-groups", prompts, 10, torch.float32)


def test_the_same_memory_runs_more_long_sequences_at_once(models):
    """Gemma 3 with Gemma 3's own pattern (five sliding layers to one global) and the same KV
    bytes: 56-token prompts with a window of 6 hold about a sixth of the blocks a whole
    cache gives them, so more of them run at once, with the same tokens."""
    root = models["gemma3"].parent
    model_dir = build_tiny_model(root / "g3-six", "gemma3", seed=7, sliding_window_pattern=6,
                                 rope_parameters=gemma.GEMMA3_ROPE, **{**gemma.SHAPE, "num_hidden_layers": 6})
    prompts = [list(range(10 + i, 66 + i)) for i in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    per_token = LLM(str(model_dir), dtype="float64", num_kv_blocks=16).engine.arch.kv_bytes_per_token(8)
    peaks, outs, sizes = {}, {}, {}
    for hybrid in (False, True):  # 60 blocks of a whole cache: three of these sequences at once
        llm = LLM(str(model_dir), dtype="float64", block_size=4, kv_cache_memory=60 * 4 * per_token,
                  max_num_batched_tokens=64, hybrid_kv_cache=hybrid)
        outs[hybrid] = tokens(llm.generate(prompts, params, use_tqdm=False))
        peaks[hybrid] = max(s.num_running for s in llm.engine.step_trace)
        sizes[hybrid] = llm.engine.runner.kv_cache_bytes
    assert abs(sizes[True] - sizes[False]) <= sizes[False] // 50  # (both round down to whole blocks)
    assert outs[True] == outs[False] == gemma.hf_greedy(model_dir, prompts, 8)
    assert peaks[False] <= 4 and peaks[True] >= 2 * peaks[False], peaks


@pytest.mark.parametrize("family", ["gemma3-two-groups", "gpt_oss", "mistral-window"])
def test_two_tensor_parallel_ranks_equal_one(models, family):
    """Each rank holds its heads' share of every page and reads each group's tables, which
    rank 0 sends with the step: one rank's tokens and logprobs (to 1e-9), and HF's."""
    import gc

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(models[family]), dtype="float64", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64,
                  block_size=4, hybrid_kv_cache=True)
        two = llm.generate(gemma.LONG, params, use_tqdm=False)
        del llm
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    one = LLM(str(models[family]), dtype="float64", num_kv_blocks=64, block_size=4,
              hybrid_kv_cache=True).generate(gemma.LONG, params, use_tqdm=False)
    for a, b in zip(two, one, strict=True):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=1e-9)
    assert tokens(two) == tokens(one) == reference(models, family, gemma.LONG, 12)


def test_a_draft_model_drafts_over_the_global_tables(models):
    """A draft model keeps its own cache over the same block ids and reads the global
    layers' tables (never released); every page counts its share of the draft's K/V."""
    model_dir = str(models["gemma3"])
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, block_size=4, hybrid_kv_cache=True,
              speculative_method="draft_model", speculative_model=model_dir)
    assert tokens(llm.generate(gemma.LONG, gemma.PARAMS, use_tqdm=False)) == reference(models, "gemma3", gemma.LONG, 16)
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > 0  # (its own draft: every draft is accepted)


def test_lora_adapters_keep_their_own_prefixes(models, tmp_path):
    """Adapters on every projection of both kinds of layer, over a shared prefix: each
    request gets HF's tokens with its adapter merged, and a prefix hit (every group's blocks)
    never crosses adapters (the hashes are salted with the adapter)."""
    from conveyor import LoRARequest
    from tests.test_lora import SPECS, merged_reference, write_adapter

    model_dir = models["gemma3-two-groups"]
    path = write_adapter(tmp_path / "everything", model_dir, *SPECS["everything"], seed=0, std=0.2)
    lora = LoRARequest("everything", 1, str(path))
    prompts = [gemma.LONG[0] * 3 + p for p in gemma.LONG[:3]]
    want = (merged_reference(model_dir, None, prompts, 12, attn_implementation="eager")
            + merged_reference(model_dir, path, prompts, 12, attn_implementation="eager"))
    assert want[:3] != want[3:]
    llm = LLM(str(model_dir), dtype="float64", enable_lora=True, num_kv_blocks=128, block_size=4,
              hybrid_kv_cache=True, max_num_batched_tokens=16)
    outs = llm.generate(prompts * 2, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False,
                        lora_request=[None] * 3 + [lora] * 3)
    assert tokens(outs) == want
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_a_draft_model_over_a_table_that_slides_is_refused(models):
    """Where every layer slides the one table releases blocks: a draft model's global layers
    would read the null block there."""
    path = str(models["mistral-window"])
    with pytest.raises(ConfigError, match="draft model"):
        LLM(path, dtype="float64", num_kv_blocks=16, hybrid_kv_cache=True, speculative_method="draft_model",
            speculative_model=path)


@pytest.mark.parametrize("receiver", ["hybrid", "whole"])
@pytest.mark.parametrize("sender", ["hybrid", "whole"])
@pytest.mark.parametrize("family", ["gemma3-two-groups", "mistral-window"])
def test_kv_handed_over_between_engines(models, family, sender, receiver):
    """Prefill/decode disaggregation: a hybrid prefill engine hands over every layer's K/V,
    zeros where its sliding tables released blocks (no query reads them again); a hybrid
    decode engine keeps, of each sliding layer, the blocks from its next query's window on.
    Either way round, the tokens of one engine doing both; every block comes back."""
    from conveyor.config import EngineConfig
    from conveyor.engine import Engine
    from tests.test_disaggregation import disaggregated, run

    base = LLM(str(models[family]), dtype="float64", num_kv_blocks=16).engine
    prompts = [p + gemma.LONG[-1] for p in gemma.LONG]  # 7-39 tokens: most outgrow the window
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(prompts)

    def engine(kind: str, **options) -> Engine:
        config = EngineConfig.from_kwargs(num_kv_blocks=64, block_size=4, hybrid_kv_cache=kind == "hybrid", **options)
        return Engine.from_model(config, base.runner.model, None)

    one = engine("whole")
    for i, p in enumerate(prompts):
        one.add_request(f"r{i}", p, params[i])
    want = {rid: out.outputs[0].token_ids for rid, out in run(one).items()}
    decode = engine(receiver, kv_receive_space=1 << 20)
    assert disaggregated(engine(sender), decode, prompts, params) == want
    assert decode.num_kv_received == len(prompts) and decode.num_kv_recomputed == 0
    bm = decode.scheduler.block_manager
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and bm.num_free_blocks == bm.num_blocks


def test_a_cache_too_small_for_one_sequence_is_refused(models):
    with pytest.raises(ConfigError, match="hold no sequence: one takes a block of each of its 3 tables"):
        LLM(str(models["gemma3-two-groups"]), dtype="float64", num_kv_blocks=2, hybrid_kv_cache=True)


def test_a_model_without_a_sliding_window_is_refused(tmp_path):
    llama = build_tiny_model(tmp_path / "llama", "llama", seed=1)
    with pytest.raises(ConfigError, match="within one sliding window"):
        LLM(str(llama), dtype="float64", num_kv_blocks=16, hybrid_kv_cache=True)



@pytest.mark.parametrize("family", ["gemma3", "gemma3-two-groups", "mistral-window"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_graphs_fixed_buffers_take_the_sliding_tables(models, family, preemption_mode):
    """The CUDA graphs' padded fixed-buffer decode over a hybrid cache (each sliding group's
    slots and tables in buffers of their own, released blocks the scratch block): HF's tokens,
    as the eager steps give them, with blocks released while decoding and sequences preempted
    (the cache holds a third of them at once)."""
    from tests.runner.test_cuda_graphs import graphed

    prompts = gemma.LONG
    options = {"num_kv_blocks": 30, "block_size": 4}  # about a third of what the six want (OPTIONS' "preempt")
    if family == "mistral-window":  # one sliding table: a sequence holds a window's and a chunk's pages
        options = {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8}
    if preemption_mode == "swap":
        options["num_swap_blocks"] = 200
    llm = LLM(str(models[family]), dtype="float64", hybrid_kv_cache=True, preemption_mode=preemption_mode,
              **options)
    sizes = graphed(llm, max_batch=4, capture=False)
    assert tokens(llm.generate(prompts, gemma.PARAMS, use_tqdm=False)) == reference(models, family, prompts, 16)
    assert sizes and max(sizes) > 1  # graphed steps of several sequences (3 pads to 4)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_hybrid_cache_captures_its_decode_on_gpu(models):
    """Gemma 3 with two sliding groups on a GPU in bfloat16: its decode steps are captured with
    the groups' tables in the graphs' buffers, and give the tokens of the same fixed-buffer
    forward run eagerly."""
    from tests.runner.test_cuda_graphs import graphed

    outs = []
    for capture in (True, False):
        llm = LLM(str(models["gemma3-two-groups"]), device="cuda", dtype="bfloat16", hybrid_kv_cache=True,
                  num_kv_blocks=64, block_size=4, cuda_graph_max_batch=8)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.captured
        if not capture:
            graphed(llm, max_batch=8, capture=False)
        outs.append(tokens(llm.generate(gemma.LONG, gemma.PARAMS, use_tqdm=False)))
    assert outs[0] == outs[1]
