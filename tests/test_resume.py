"""`Engine.add_request(resume=...)`: a request goes on in a new engine from where another left it.

This is what an engine process started again after a crash does with the requests that were in
flight (tests/server/test_engine_process.py kills real ones). Here, on SmolLM2 with its
tokenizer: the text emitted before the cut plus the text after it is the text of a request never
interrupted, also where a stop string's hold-back spans the cut, and a seeded request draws the
same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from conveyor import EngineConfig, InvalidRequestError, SamplingParams
from conveyor.engine import Engine, Resume
from conveyor.sequence import RequestMetrics

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def base(smollm2: str) -> Engine:
    return Engine.from_config(EngineConfig.from_kwargs(model=smollm2, kv_cache_memory=64 << 20))


def fresh(base: Engine) -> Engine:
    return Engine.from_model(base.config, base.runner.model, base.tokenizer)


def drive(engine: Engine, until: int | None = None) -> tuple[list[int], str, list[int], str | None]:
    """Step until `until` tokens came out (or to the end): (tokens, text, logprob ids, finish
    reason) emitted."""
    tokens: list[int] = []
    text = ""
    logprob_ids: list[int] = []
    reason = None
    while engine.has_unfinished_requests() and (until is None or len(tokens) < until):
        for out in engine.step():
            c = out.outputs[0]
            tokens += c.delta_token_ids
            text += c.delta_text
            logprob_ids += [lp.token_id for lp in c.logprobs or []]
            reason = c.finish_reason
    return tokens, text, logprob_ids, reason


CASES = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, output_kind="delta", logprobs=1),
    # Text is held back while it could be the start of the stop string: " a" (the 3rd token,
    # then released by " wise"), " a beautiful" (then stopped by " garden"). Cuts fall there.
    "stop string": SamplingParams(max_tokens=40, temperature=0.0, stop=(" a beautiful garden",), output_kind="delta"),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, output_kind="delta"),
}


def check_cut(make: Callable[[], Engine], prompt: str, params: SamplingParams, cut: int,
              reference: tuple[list[int], str, list[int], str | None], exact: bool = True) -> tuple[Engine, Engine]:
    """One engine serves `prompt` until `cut` tokens came out (`exact`: not more; else the step
    that passed `cut` may have emitted several), a second resumes it: together they emit the
    uninterrupted `reference`. Returns both engines."""
    first = make()
    first.add_request("r", prompt, params, stream=True)
    tokens, text, lp, _ = drive(first, until=cut)
    assert len(tokens) == cut if exact else len(tokens) >= cut
    seq = first._requests["r"].seq
    metrics = dataclasses.replace(seq.metrics, token_times=list(seq.metrics.token_times))
    second = make()
    second.add_request("r", prompt, params, stream=True, resume=Resume(tokens, len(text), metrics))
    more_tokens, more_text, more_lp, reason = drive(second)
    ref_tokens, ref_text, ref_lp, ref_reason = reference
    assert tokens + more_tokens == ref_tokens, cut
    assert text + more_text == ref_text, cut
    assert reason == ref_reason
    if params.logprobs is not None:
        assert lp + more_lp == ref_lp
    assert second.scheduler.block_manager.num_used_blocks == 0
    return first, second


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_emits_the_rest_of_the_uninterrupted_text(base: Engine, case: str) -> None:
    params = CASES[case]
    whole = fresh(base)
    whole.add_request("r", PROMPT, params, stream=True)
    reference = drive(whole)
    assert len(reference[0]) > 4 and reference[1]
    n = len(reference[0])
    for cut in sorted({1, 3, n // 2, n - 2, n - 1}):
        first, _ = check_cut(lambda: fresh(base), PROMPT, params, cut, reference)
        assert first.scheduler.num_draft_tokens == 0


def test_a_resume_with_nothing_left_to_generate_is_refused(base: Engine) -> None:
    engine = fresh(base)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(InvalidRequestError):
        engine.add_request("r", PROMPT, params, resume=Resume([1, 2, 3], 0, RequestMetrics(0.0)))
    assert not engine.has_unfinished_requests()


REPEATING = "Say it again and again: one two three, one two three, one two three, one two three,"


@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_with_speculative_decoding_emits_the_uninterrupted_text(base: Engine, case: str) -> None:
    """Engines that verify drafts (a step may emit several tokens, so a cut falls where a step
    ends) resume to the text of an engine without drafts, never interrupted: a seeded
    request's generator is where one row of noise per kept token leaves it."""
    params = CASES[case]
    if case == "stop string":
        params = dataclasses.replace(params, stop=("three, one two",))
    whole = fresh(base)
    whole.add_request("r", REPEATING, params, stream=True)
    reference = drive(whole)
    config = EngineConfig.from_kwargs(**{**base.config.flat(), "speculative_method": "ngram", "prompt_lookup_min": 1})
    drafted = 0
    n = len(reference[0])
    for cut in (1, n // 2, n - 2):
        first, second = check_cut(lambda: Engine.from_model(config, base.runner.model, base.tokenizer),
                                  REPEATING, params, cut, reference, exact=False)
        drafted += first.scheduler.num_accepted_tokens + second.scheduler.num_accepted_tokens
    assert drafted > 0
