"""kv_cache_dtype: a float16 KV cache under a float32 model on CPU."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError

PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 40, 77)]


def run(path, kv_cache_dtype: str, **kw):
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, kv_cache_dtype=kv_cache_dtype, **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [None, 16])  # 16: prompts in chunks that read the cache back
def test_float16_cache_holds_twice_the_tokens_and_stays_close(tiny_models, family, chunk):
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 4}
    full, ref = run(tiny_models[family], "auto", **kw)
    half, out = run(tiny_models[family], "float16", **kw)
    assert all(c.dtype == torch.float16 for c in half.engine.runner.kv_caches)
    assert half.engine.runner.num_blocks // 2 == full.engine.runner.num_blocks  # floor division of the budget
    for a, b in zip(out, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(la.logprob - lb.logprob) < 2e-2
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_bad_kv_cache_dtype_says_why(tiny_models):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(tiny_models["llama"]), kv_cache_dtype="int4")
