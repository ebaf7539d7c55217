"""The engine's `logprobs_mode` (vLLM's): raw log-probabilities (the default), raw logits, or the
processed distribution each token was drawn from, as log-probabilities or logits.

Three engines on the tiny Llama (float64) sample the same seeded requests: the tokens do not
depend on the mode, so each mode's values are checked against the raw logits of the same
positions: raw log-probabilities are the logits less one constant a row; processed ones at
temperature T with top-k K are the logits over T, renormalised over the K kept tokens, and
-inf past them.
"""

from __future__ import annotations

import math

import pytest

from conveyor import LLM, ConfigError, SamplingParams
from conveyor.beam_search import BeamSearchParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def engines(tiny_models):
    model = str(tiny_models["llama"])
    return {mode: LLM(model, dtype="float64", num_kv_blocks=64, logprobs_mode=mode)
            for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}


def run(llm: LLM, params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_raw_logits_are_the_raw_logprobs_plus_one_constant_a_row(engines):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=6)
    lps, logits = run(engines["raw_logprobs"], params), run(engines["raw_logits"], params)
    for a, b in zip(lps, logits, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            shift = y.logprob - x.logprob  # log of the row's partition function
            assert abs(shift) > 1e-3
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v + shift for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 4), (1.3, 0)])
def test_processed_values_are_the_drawn_distribution(engines, temperature, top_k):
    k = 6
    params = SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, seed=3, logprobs=k)
    raw = run(engines["raw_logits"], params)
    lps, logits = run(engines["processed_logprobs"], params), run(engines["processed_logits"], params)
    for r, p, q in zip(raw, lps, logits, strict=True):
        assert r.token_ids == p.token_ids == q.token_ids  # (the mode changes no draw)
        for x, y, z in zip(r.logprobs, p.logprobs, q.logprobs, strict=True):
            kept = x.top[:top_k] if top_k else x.top
            scaled = [v / temperature for _, v in kept]
            if top_k:  # renormalised over the kept tokens; the rest -inf
                norm = math.log(sum(math.exp(v) for v in scaled))
                assert [v for _, v in y.top[top_k:]] == [-math.inf] * (k - top_k)
                assert [v for _, v in z.top[top_k:]] == [-math.inf] * (k - top_k)
                assert [v - norm for v in scaled] == pytest.approx([v for _, v in y.top[:top_k]], abs=1e-5)
            assert scaled == pytest.approx([v for _, v in z.top[: len(scaled)]], abs=1e-5)
            assert [t for t, _ in y.top][: len(kept)] == [t for t, _ in kept]
            assert y.logprob == pytest.approx(dict(y.top).get(y.token_id, y.logprob))


def test_processed_logprobs_see_a_logits_processor_and_raw_ones_do_not(engines):
    first = run(engines["raw_logprobs"], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]

    def ban(out, row):
        row[first] = float("-inf")
        return row

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, logits_processors=[ban])
    raw = run(engines["raw_logprobs"], params)[0].logprobs[0]
    processed = run(engines["processed_logprobs"], params)[0].logprobs[0]
    assert raw.top[0][0] == first and first not in dict(processed.top)
    assert sum(math.exp(v) for _, v in processed.top) <= 1.0 + 1e-9


def test_beam_search_scores_stay_logprobs_under_a_logits_mode(engines):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    want = engines["raw_logprobs"].beam_search(PROMPTS[:1], params)[0]
    got = engines["raw_logits"].beam_search(PROMPTS[:1], params)[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.cum_logprob for s in got.sequences] == pytest.approx([s.cum_logprob for s in want.sequences])


def test_an_unknown_mode_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="logprobs_mode"):
        LLM(str(tiny_models["llama"]), num_kv_blocks=16, logprobs_mode="softmax")
