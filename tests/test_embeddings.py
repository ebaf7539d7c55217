"""Embeddings (vLLM's pooling: `LLM.embed`, `SamplingParams.for_pooling`) against HF transformers.

The reference is HF's `last_hidden_state` (after the final norm) over the whole prompt in
float64, pooled by hand: the last token's row, the mean of the rows, or the first row, then cut
to `dimensions` and scaled to unit length. (They agree to about 3e-8: HF computes RoPE's
angles in float32 even in a float64 model.) Every way a prompt reaches the model in pieces
(chunks, recompute or swap after preemption, async steps, a prefix another request has cached,
speculative decoding beside it) must give the same vector, and the generation requests that
run beside embedding requests must get the same tokens as without them.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, InvalidRequestError, PoolingParams, SamplingParams

VOCAB = 384


def hf_hidden(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


def reference(hidden: torch.Tensor, pooling: PoolingParams) -> list[float]:
    v = {"last": hidden[-1], "mean": hidden.mean(dim=0), "max": hidden.amax(dim=0),
         "cls": hidden[0]}[pooling.pooling_type or "last"]
    if pooling.dimensions is not None:
        v = v[: pooling.dimensions]
    if pooling.normalize:
        v = v / v.norm()
    return v.tolist()


POOLINGS = [
    PoolingParams(),
    PoolingParams("mean"),
    PoolingParams("cls"),
    PoolingParams("last", normalize=False),
    PoolingParams("mean", normalize=False, dimensions=5),
    PoolingParams("last", dimensions=7),
    PoolingParams("max"),
    PoolingParams("max", normalize=False, dimensions=4),
]


@pytest.fixture(scope="module")
def cases(tiny_models):
    rng = random.Random(1)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]  # a prefix some prompts share
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    prompts += [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    return prompts, hf_hidden(str(tiny_models["llama"]), prompts)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8, "block_size": 4},  # prompts in chunks of up to 8
        # preemption mid-prompt: a "mean" computed again from its first token, or swapped out with its sum
        {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8},
        {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8, "preemption_mode": "swap",
         "num_swap_blocks": 64},
        {"async_scheduling": True, "max_num_batched_tokens": 8},
        {"speculative_method": "ngram", "prompt_lookup_min": 1},
        {"speculative_method": "draft_model"},  # the model drafting for itself
        {"enable_prefix_caching": True, "block_size": 4},
        {"prefill_mode": "prefill_first"},
    ],
    ids=["default", "chunked-8", "preempt", "swap", "async-chunked", "ngram", "draft-model", "prefix-cache",
         "prefill-first"],
)
def test_embeddings_equal_hf_beside_generation(tiny_models, cases, options):
    prompts, hidden = cases
    path = str(tiny_models["llama"])
    options = {"num_kv_blocks": 128, **options}
    if options.get("speculative_method") == "draft_model":
        options["speculative_model"] = path
    gen_prompts = [[7, 8, 9, 10, 7, 8, 9], [11, 12, 13], [200, 201, 202, 203, 204]]
    gen_params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = LLM(path, dtype="float64", **options).generate(gen_prompts, gen_params, use_tqdm=False)

    engine = LLM(path, dtype="float64", **options).engine
    if options.get("enable_prefix_caching"):  # the shared prefix cached by a generation request
        engine.add_request("warm", prompts[-1], SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    # Generation requests start first; embedding requests join them mid-decode.
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, gen_params)
    engine.step()
    want = {}
    for i, p in enumerate(prompts):
        pooling = POOLINGS[i % len(POOLINGS)]
        engine.add_request(f"emb-{i}", p, SamplingParams.for_pooling(pooling))
        want[f"emb-{i}"] = reference(hidden[i], pooling)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
    for rid, vector in want.items():
        out = got[rid]
        assert out.embedding == pytest.approx(vector, abs=1e-6), rid
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
        assert out.outputs[0].finish_reason == "stop"
    if options["num_kv_blocks"] == 12:
        assert any(got[rid].num_preemptions for rid in want)
    for i, a in enumerate(alone):
        assert got[f"gen-{i}"].outputs[0].token_ids == a.outputs[0].token_ids
        assert got[f"gen-{i}"].embedding is None
    if options.get("enable_prefix_caching"):  # "last" may start after a hit; "mean" and "cls" may not
        hits = {rid: got[rid].num_cached_tokens for rid in want}
        shared = [f"emb-{i}" for i in range(8, 12)]
        assert any(hits[r] for r in shared if POOLINGS[int(r[4:]) % len(POOLINGS)].pooling_type in (None, "last"))
        assert all(not hits[r] for r in want  # (None: the model's own, "last" for a decoder)
                   if POOLINGS[int(r[4:]) % len(POOLINGS)].pooling_type not in (None, "last"))


def test_llm_embed(tiny_models, cases):
    prompts, hidden = cases
    llm = LLM(str(tiny_models["llama"]), dtype="float64")
    outs = llm.embed(prompts[:4], use_tqdm=False)
    for out, p, h in zip(outs, prompts, hidden, strict=False):
        assert out.prompt_token_ids == p and out.finished
        assert out.outputs.embedding == pytest.approx(reference(h, PoolingParams()), abs=1e-6)
        assert math.isclose(sum(x * x for x in out.outputs.embedding), 1.0, rel_tol=1e-9)
    each = [PoolingParams("mean"), PoolingParams("cls", dimensions=3)]
    outs = llm.embed(prompts[:2], each, use_tqdm=False)
    for out, h, pooling in zip(outs, hidden, each, strict=False):
        assert out.outputs.embedding == pytest.approx(reference(h, pooling), abs=1e-6)
    assert len(outs[1].outputs.embedding) == 3


def test_a_prompt_may_fill_the_context_and_no_more(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", max_model_len=32, block_size=4)
    full = list(range(3, 35))
    assert len(llm.embed([full], use_tqdm=False)[0].outputs.embedding) == llm.engine.runner.hidden_size
    with pytest.raises(InvalidRequestError, match="embeds at most 32"):
        llm.embed([[*full, 5]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="at most 32 tokens per sequence"):  # a completion needs room
        llm.generate([full], SamplingParams(max_tokens=1), use_tqdm=False)


def test_bad_pooling_is_refused_before_anything_runs(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float64")
    size = llm.engine.runner.hidden_size
    with pytest.raises(InvalidRequestError, match=f"have {size} values") as e:
        llm.embed([[5, 6], [7]], [PoolingParams(), PoolingParams(dimensions=size + 1)], use_tqdm=False)
    assert e.value.param == "dimensions"
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams("min")
    with pytest.raises(InvalidRequestError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidRequestError, match="generates nothing"):
        SamplingParams(max_tokens=4, pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="generates nothing"):
        SamplingParams(max_tokens=1, logprobs=1, pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="2 pooling params for 1 prompts"):
        llm.embed([[5]], [PoolingParams(), PoolingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="no K/V to hand over"):
        llm.engine.add_request("x", [5, 6], SamplingParams.for_pooling(), export_kv=True)
    assert not llm.engine.has_unfinished_requests()


def test_an_aborted_embedding_ends_without_one(tiny_models):
    engine = LLM(str(tiny_models["llama"]), dtype="float64", max_num_batched_tokens=4, block_size=4).engine
    engine.add_request("e", list(range(3, 40)), SamplingParams.for_pooling(PoolingParams("mean")))
    engine.step()  # the first chunk's rows are summed
    engine.abort_request("e")
    outs = [o for _ in range(3) for o in engine.step()]
    assert not engine.has_unfinished_requests()
    assert all(o.embedding is None for o in outs)
    assert not engine.runner._pool_sums  # the partial sum went with it


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    budget=st.sampled_from([4, 8, 13, 64]),
    block_size=st.sampled_from([2, 4, 16]),
    caching=st.booleans(),
    blocks=st.sampled_from([12, 24, 128]),
)
def test_random_schedules_pool_what_hf_computes(tiny_models, random_hidden, data, budget, block_size, caching, blocks):
    """Random prompts (sharing prefixes), poolings, arrival steps and engine shapes: each
    embedding is HF's, whatever chunking, preemption and prefix hits its prompt met."""
    prompts, hidden = random_hidden
    engine = LLM(str(tiny_models["llama"]), dtype="float64", max_num_batched_tokens=budget,
                 block_size=block_size, enable_prefix_caching=caching, num_kv_blocks=blocks * 16 // block_size).engine
    picks = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=8))
    kinds = data.draw(st.lists(st.sampled_from(POOLINGS), min_size=len(picks), max_size=len(picks)))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 6), min_size=len(picks), max_size=len(picks))))
    want, got = {}, {}
    step = 0
    pending = list(zip(arrivals, picks, kinds, strict=True))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, pooling = pending.pop(0)
            rid = f"r{len(want)}"
            if len(want) % 3 == 2:  # a generation request between them
                engine.add_request(rid + "g", prompts[i][:5], SamplingParams(max_tokens=6, ignore_eos=True))
            engine.add_request(rid, prompts[i], SamplingParams.for_pooling(pooling))
            want[rid] = reference(hidden[i], pooling)
        for out in engine.step():
            if out.finished and out.request_id in want:
                got[out.request_id] = out.embedding
        step += 1
    for rid, vector in want.items():
        assert got[rid] == pytest.approx(vector, abs=1e-6), rid


@pytest.fixture(scope="module")
def random_hidden(tiny_models):
    rng = random.Random(7)
    base = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [base[: rng.randint(1, 40)] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 8))]
               for _ in range(10)]
    return prompts, hf_hidden(str(tiny_models["llama"]), prompts)


def test_float32_on_the_cpu_kernels(tiny_models, cases):
    """float32 on the native CPU paths: a one-token prompt joins a step of decodes (the fused
    decode kernel, whose final norm runs inside it), longer ones a mixed step."""
    prompts, hidden = cases
    engine = LLM(str(tiny_models["llama"]), dtype="float32").engine
    for i in range(4):
        engine.add_request(f"gen-{i}", [5 + i, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    one = [prompts[i] for i in range(len(prompts)) if len(prompts[i]) == 1]
    assert one  # (the cases hold a one-token prompt)
    want, got = {}, {}
    for i, p in enumerate(prompts):
        pooling = POOLINGS[i % 3]
        engine.add_request(f"emb-{i}", p, SamplingParams.for_pooling(pooling))
        want[f"emb-{i}"] = reference(hidden[i], pooling)
        if len(p) == 1:  # alone with the decodes
            got.update({o.request_id: o.embedding for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.embedding for o in engine.step() if o.finished})
    for rid, vector in want.items():
        assert got[rid] == pytest.approx(vector, abs=1e-4), rid


def test_an_adapters_embeddings_are_hf_merged(tiny_models, cases, tmp_path):
    """An embedding request naming an adapter pools the adapted model's hidden states (HF with
    the adapter merged), beside base-model embeddings in the same steps."""
    from conveyor import LoRARequest
    from tests.test_lora import SPECS, merged_model, write_adapter

    prompts, hidden = cases
    path = tiny_models["llama"]
    adapter = write_adapter(tmp_path / "a", path, *SPECS["everything"], seed=5)
    llm = LLM(str(path), dtype="float64", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.embed(prompts[:6], PoolingParams("mean"), use_tqdm=False, lora_request=[lora, None] * 3)
    model = merged_model(path, adapter)
    for i, out in enumerate(outs):
        if i % 2:
            want = hidden[i]
        else:
            with torch.no_grad():
                want = model.model(torch.tensor([prompts[i]])).last_hidden_state[0]
            assert out.outputs.embedding != pytest.approx(reference(hidden[i], PoolingParams("mean")), abs=1e-3)
        assert out.outputs.embedding == pytest.approx(reference(want, PoolingParams("mean")), abs=1e-6)

