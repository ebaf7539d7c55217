"""The simulator's sliding-window layers (Gemma 2/3, gpt-oss): a windowed prompt's (query, key)
pairs against a count by brute force (hypothesis), a step's windowed shape against the
scheduler's items, the attention cost by hand, the catalog's sizes against the model cards,
the shape read from a loaded model, and a run from the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.sim.cost import RooflineCostModel, StepShape, window_pairs
from conveyor.sim.models import ModelShape, get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

# TOY with one of its two layers sliding over 8 positions.
TOY_WINDOWED = dataclasses.replace(TOY, name="toy-windowed", sliding_window=8, num_sliding_layers=1)


@given(start=st.integers(0, 100), n=st.integers(1, 60), window=st.integers(1, 80))
def test_window_pairs_count_what_each_query_sees(start, n, window):
    assert window_pairs(start, n, window) == sum(min(q + 1, window) for q in range(start, start + n))


@given(items=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=6),
       window=st.integers(1, 40))
def test_a_steps_windowed_shape(items, window):
    """Decodes read at most the window; a chunk's queries read from the window before its first
    to its last (`window + n - 1` positions at most); no window: the whole shape again."""
    from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams()
    out = SchedulerOutput(step_id=0, scheduled=[
        ScheduledSequence(seq_id=i, token_ids=[0] * n, start_pos=start, block_table=[], sample=True,
                          sampling_params=params, all_token_ids=[], prompt_len=0)
        for i, (start, n) in enumerate(items)])
    s, plain = StepShape.of(out, window), StepShape.of(out)
    assert s.window_decode_context == sum(min(a + 1, window) for a, n in items if n == 1)
    assert s.window_prefill_context == sum(min(a + n, window + n - 1) for a, n in items if n > 1)
    assert s.window_prefill_pairs == sum(window_pairs(a, n, window) for a, n in items if n > 1)
    assert (plain.window_decode_context, plain.window_prefill_pairs) == (plain.decode_context, plain.prefill_pairs)


def test_attention_cost_by_hand():
    """One layer over the whole context, one within 8 positions."""
    cost = RooflineCostModel(TOY_HW, TOY_WINDOWED, TOY_PARAMS, dtype_bytes=2)
    plain = RooflineCostModel(TOY_HW, TOY, TOY_PARAMS, dtype_bytes=2)
    one = StepShape(num_seqs=1, num_tokens=1, num_sampled=1, decode_seqs=1, decode_context=100,
                    window_decode_context=8)
    per_token = plain.breakdown(one)["attn_decode"] / 100  # both layers, one context token
    assert cost.breakdown(one)["attn_decode"] == pytest.approx(per_token * (100 + 8) / 2)
    prompt = StepShape(num_seqs=1, num_tokens=64, num_sampled=1, prefill_pairs=2080, prefill_context=64,
                       window_prefill_pairs=window_pairs(0, 64, 8), window_prefill_context=64)
    both = plain.breakdown(prompt)["attn_prefill"]  # compute-bound: by pairs
    assert cost.breakdown(prompt)["attn_prefill"] == pytest.approx(both * (2080 + 484) / 2 / 2080)


def test_catalog_sizes_match_the_model_cards():
    """Gemma 3 27B's text model: 27.0 B weights, 52 of its 62 layers sliding over 1,024; gpt-oss:
    20.9 B and 116.8 B (the cards' 20.91 and 116.83 less norms, biases and sinks), 3.6 B and
    5.1 B active without the embeddings, half their layers sliding over 128."""
    gemma = get_model("gemma-3-27b")
    assert gemma.num_params / 1e9 == pytest.approx(27.0, abs=0.05)
    assert (gemma.sliding_window, gemma.num_sliding_layers, gemma.num_layers) == (1024, 52, 62)
    for name, total, active, layers in (("gpt-oss-20b", 20.91, 3.61, 24), ("gpt-oss-120b", 116.83, 5.13, 36)):
        m = get_model(name)
        assert m.num_params / 1e9 == pytest.approx(total, rel=2e-3)
        assert (m.active_params - m.vocab_size * m.hidden_size) / 1e9 == pytest.approx(active, rel=2e-3)
        assert (m.sliding_window, m.num_sliding_layers) == (128, layers // 2)


def test_shape_of_a_loaded_model_matches_its_config(tmp_path):
    """The windows the engine reads are the simulator's: Gemma 2 and 3, gpt-oss, an image-text
    Gemma 3 config (its text model, with Gemma3TextConfig's defaults)."""
    from conveyor.models.loader import read_hf_arch
    from tests.conftest import build_tiny_model
    from tests.models.test_gemma import SHAPE
    from tests.models.test_gpt_oss import SHAPE as OSS

    shapes = {"gemma2": SHAPE, "gemma3": {**SHAPE, "sliding_window_pattern": 3}, "gpt_oss": OSS}
    for family, shape in shapes.items():
        folder = build_tiny_model(tmp_path / family, family, **shape)
        from_arch = ModelShape.from_arch(read_hf_arch(folder), family)
        from_config = ModelShape.from_hf_config(json.loads((folder / "config.json").read_text()), family)
        assert dataclasses.replace(from_arch, eos_token_ids=()) == dataclasses.replace(from_config, eos_token_ids=())
        assert from_arch.sliding_window == 6 and from_arch.num_sliding_layers == (3 if family == "gemma3" else 2)
    hub = ModelShape.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "sliding_window": 1024}}, "gemma-3-4b")  # gemma-3-4b-it's
    assert (hub.num_sliding_layers, hub.sliding_window, hub.head_dim, hub.vocab_size) == (29, 1024, 256, 262208)
    assert hub.num_params / 1e9 == pytest.approx(3.88, abs=0.01)  # its text model (the card's 4 B has the vision tower)


def test_simulate_gemma_end_to_end(tmp_path, capsys):
    from conveyor.cli import main

    out = tmp_path / "sim"
    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "gemma-3-27b", "--num-requests", "16",
               "--request-rate", "inf", "--input-len", "4096", "--output-len", "32", "--out", str(out)])
    assert rc == 0
    assert "16/16 done" in capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    assert result["simulation"]["model"]["num_sliding_layers"] == 52


def test_a_hybrid_cache_plans_pages_of_the_global_layers_count():
    """`--hybrid-kv-cache`: Gemma 3 27B's 10 global layers make a page, its 52 sliding ones six
    groups; the same bytes hold 62 / 10 the blocks, and the block manager is the engine's."""
    from conveyor.config import EngineConfig
    from conveyor.core.block_manager import HybridLayout
    from conveyor.sim.engine import build_sim_engine, describe_capacity
    from conveyor.sim.hardware import get_hardware

    hw, model = get_hardware("h100-sxm"), get_model("gemma-3-27b")
    whole = build_sim_engine(EngineConfig.from_kwargs(), hw, model)
    hybrid = build_sim_engine(EngineConfig.from_kwargs(hybrid_kv_cache=True), hw, model)
    assert hybrid.scheduler.block_manager.layout == HybridLayout(1024, 10, 6)
    assert hybrid.num_kv_blocks == pytest.approx(whole.num_kv_blocks * 62 / 10, rel=1e-3)
    a, b = describe_capacity(whole), describe_capacity(hybrid)
    assert b["kv_gib"] == pytest.approx(a["kv_gib"], rel=1e-3)
    assert a["hybrid_kv_cache"] is None and b["hybrid_kv_cache"]["num_window_groups"] == 6
    # The whole cache caps the context at what it holds; the hybrid one holds a 128K sequence
    # (8,192 global blocks, six windows and chunks of 193 blocks: 9,350 of 16,952).
    assert whole.max_model_len == whole.num_kv_blocks * 16 < 50_000
    assert hybrid.max_model_len == model.max_position_embeddings == 131_072


def test_a_hybrid_cache_serves_more_long_requests_at_once():
    """24 requests of 8K prompts on one H100: the whole cache runs six such sequences at once,
    the hybrid one more than twice as many, so it finishes sooner."""
    from conveyor import SamplingParams
    from conveyor.config import EngineConfig
    from conveyor.sim.engine import build_sim_engine
    from conveyor.sim.hardware import get_hardware

    hw, model = get_hardware("h100-sxm"), get_model("gemma-3-27b")
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    peaks, times = {}, {}
    for hybrid in (False, True):
        engine = build_sim_engine(EngineConfig.from_kwargs(hybrid_kv_cache=hybrid), hw, model, trace=False)
        for i in range(24):
            engine.add_request(str(i), [5 + i] * 8192, params)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        peaks[hybrid], times[hybrid] = peak, engine.clock()
    assert peaks[False] <= 6 and peaks[True] >= 2.5 * peaks[False], peaks
    assert times[True] < times[False]


def test_a_hybrid_cache_is_not_modelled_over_pipeline_stages():
    from conveyor.config import ConfigError, EngineConfig
    from conveyor.sim.engine import build_sim_engine
    from conveyor.sim.hardware import get_hardware

    with pytest.raises(ConfigError, match="pipeline"):
        build_sim_engine(EngineConfig.from_kwargs(hybrid_kv_cache=True, pipeline_parallel_size=2),
                         get_hardware("h100-sxm"), get_model("gemma-3-27b"))
