"""Text in, text out on the real SmolLM2: chat template, stop strings, streaming deltas."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.sampling_params import InvalidRequestError
from conveyor.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, kv_cache_memory=256 << 20)


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def test_default_model_chat_answers_and_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], GREEDY, use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "4" in text
    assert out.outputs[0].finish_reason == "stop"
    assert "<|im_end|>" not in text
    assert out.outputs[0].token_ids[-1] in llm.engine.scheduler.eos_token_ids


def test_chat_accepts_many_conversations(llm):
    convs = [[{"role": "user", "content": f"Say the number {i}."}] for i in range(3)]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 3 and all(o.outputs[0].text for o in outs)


def test_stop_string_is_cut_from_the_text(llm):
    base = llm.generate(["The days of the week are Monday,"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Wednesday" in base.text, base.text
    out = llm.generate(
        ["The days of the week are Monday,"],
        SamplingParams(max_tokens=40, temperature=0.0, stop=["Wednesday"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Wednesday"
    assert out.text == base.text[: base.text.index("Wednesday")]
    kept = llm.generate(
        ["The days of the week are Monday,"],
        SamplingParams(max_tokens=40, temperature=0.0, stop=["Wednesday"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text.endswith("Wednesday")


def test_streamed_deltas_concatenate_to_the_final_text(llm):
    engine = llm.engine
    sp = SamplingParams(max_tokens=60, temperature=0.0, stop=["Friday"])
    ids = llm.tokenizer.encode("The days of the week are Monday,")
    engine.add_request("s", ids, sp, stream=True)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.outputs[0].text
    assert "Fri" not in final.outputs[0].text  # a stop-string prefix is never streamed


def _stream(engine, rid, ids, params):
    engine.add_request(rid, ids, params, stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=60, temperature=0.0, stop=["Friday"], logprobs=2),
    SamplingParams(max_tokens=30, temperature=0.8, seed=5, logprobs=0),
    SamplingParams(max_tokens=25, temperature=0.0),
], ids=["stop+logprobs", "sampled", "plain"])
def test_output_kinds_hold_the_same_request(llm, params):
    """"delta" outputs concatenate to the cumulative stream's final output (text, token ids,
    logprobs), one output for each of its; "final_only" is that final output alone."""
    engine = llm.engine
    ids = llm.tokenizer.encode("The days of the week are Monday,")
    cumulative = _stream(engine, "c", ids, params)
    final = cumulative[-1].outputs[0]
    assert final.logprobs is None or len(final.logprobs) == len(final.token_ids)
    delta = _stream(engine, "d", ids, dataclasses.replace(params, output_kind="delta"))
    assert len(delta) == len(cumulative) and delta[-1].finished
    for d, c in zip(delta, cumulative, strict=True):  # each output: the cumulative one's news
        got, want = d.outputs[0], c.outputs[0]
        assert got.text == got.delta_text == want.delta_text
        assert got.token_ids == got.delta_token_ids == want.delta_token_ids
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.token_ids
    if final.logprobs is not None:
        assert [lp for o in delta for lp in o.outputs[0].logprobs] == final.logprobs
    assert delta[-1].outputs[0].finish_reason == final.finish_reason
    only = _stream(engine, "f", ids, dataclasses.replace(params, output_kind="final_only"))
    assert len(only) == 1 and only[0].finished
    assert only[0].outputs[0].text == final.text and only[0].outputs[0].token_ids == final.token_ids
    assert only[0].outputs[0].logprobs == final.logprobs


@pytest.mark.parametrize("interval", [3, 8])
def test_a_stream_interval_sends_every_few_tokens_the_same_request(llm, interval):
    """stream_interval (vLLM's, SGLang's): the first token at once, then an output every
    `interval` tokens and the last at the end; delta and cumulative streams hold the request
    an interval of 1 gives (text, ids, logprobs)."""
    from conveyor.config import EngineConfig
    from conveyor.engine import Engine

    ids = llm.tokenizer.encode("The days of the week are Monday,")
    params = SamplingParams(max_tokens=29, temperature=0.0, logprobs=1, ignore_eos=True)
    want = _stream(llm.engine, "one", ids, params)
    config = dataclasses.replace(llm.engine.config, scheduler=dataclasses.replace(
        llm.engine.config.scheduler, stream_interval=interval))
    engine = Engine.from_model(config, llm.engine.runner.model, llm.engine.tokenizer)
    for kind in ("delta", "cumulative"):
        outs = _stream(engine, kind, ids, dataclasses.replace(params, output_kind=kind))
        counts = [len(o.outputs[0].delta_token_ids) for o in outs]
        assert counts[0] == 1 and all(c == interval for c in counts[1:-1]) and 1 <= counts[-1] <= interval
        assert sum(counts) == 29 and len(outs) == 1 + -(-28 // interval)
        final = outs[-1].outputs[0]
        text = "".join(o.outputs[0].delta_text for o in outs)
        assert text == want[-1].outputs[0].text and (kind == "delta" or final.text == text)
        got_ids = [t for o in outs for t in o.outputs[0].delta_token_ids]
        assert got_ids == want[-1].outputs[0].token_ids
        lps = [lp for o in outs for lp in o.outputs[0].logprobs] if kind == "delta" else final.logprobs
        assert lps == want[-1].outputs[0].logprobs
    with pytest.raises(Exception, match="stream_interval"):
        EngineConfig.from_kwargs(model="m", stream_interval=0)


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="partial")


def test_detokenizer_never_splits_utf8(llm):
    tok = llm.tokenizer
    text = "Emoji 🎉🚀 and 日本語 and café — ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.delta())
    pieces.append(detok.delta(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert len(ids) > len([p for p in pieces if p])  # some characters span several tokens


def _detokenize(tok, context, ids, skip=True, stream=True):
    detok = IncrementalDetokenizer(tok, context, skip_special_tokens=skip, stream=stream)
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.delta())
    pieces.append(detok.delta(final=True))
    return detok, pieces


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=40), st.text(max_size=20), st.booleans())
def test_the_stream_decoder_gives_the_windows_text(llm, text, before, skip):
    """Tokenizers' own incremental decoder (the fast way) and the two-window way stream the
    same text, never a cut character, and that text is what decoding it after its context gives."""
    tok = llm.tokenizer
    context = tok.encode(before, add_special_tokens=False)[-6:]
    ids = tok.encode(text, add_special_tokens=False)
    fast, fast_pieces = _detokenize(tok, context, ids, skip)
    slow, slow_pieces = _detokenize(tok, context, ids, skip, stream=False)
    assert fast.text == slow.text == "".join(fast_pieces) == "".join(slow_pieces)
    base, whole = tok.decode(context, skip), tok.decode(context + ids, skip)
    if "\ufffd" not in whole:  # characters the tokenizer cannot spell come back as U+FFFD
        assert fast._step is not None, "SmolLM2's tokenizer has a stream decoder"
        assert fast.text == whole[len(base) :]
        assert all("\ufffd" not in p for p in fast_pieces)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=30), st.booleans())
def test_the_stream_decoder_on_any_ids_is_decode(llm, ids, skip):
    """Any ids, special tokens and cut characters included: the text is `decode`'s, but for a
    character still cut at the end."""
    tok = llm.tokenizer
    detok, _ = _detokenize(tok, [], ids, skip)
    want = tok.decode(ids, skip)
    assert detok.text == want or (want.endswith("\ufffd") and want.startswith(detok.text))


def test_a_failing_stream_decoder_hands_over_to_the_windows(llm, monkeypatch):
    tok = llm.tokenizer
    ids = tok.encode("Emoji 🎉🚀 and 日本語 and café — ok", add_special_tokens=False)
    make = tok.stream_decoder
    calls = []

    def failing(context, skip):
        step = make(context, skip)

        def flaky(token_id):
            calls.append(token_id)
            if len(calls) == 3:  # the 🎉 is cut here: its first token is in, its last not
                raise Exception("Invalid prefix encountered")
            return step(token_id)

        return flaky

    monkeypatch.setattr(tok, "stream_decoder", failing)
    detok, pieces = _detokenize(tok, [], ids)
    assert len(calls) == 3 and detok._step is None
    assert detok.text == "".join(pieces) == tok.decode(ids)


def test_detokenizer_holds_back_a_possible_stop_prefix(llm):
    tok = llm.tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=["STOP here"])
    ids = tok.encode("abc STOP", add_special_tokens=False)
    for t in ids:
        detok.add(t)
    assert detok.delta() == "abc "  # "STOP" could still become "STOP here"
    for t in tok.encode(" now", add_special_tokens=False):
        detok.add(t)
    assert detok.delta() == "STOP now"


def test_seeded_sampling_repeats(llm):
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=42)
    a = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0].outputs[0].text
    b = llm.generate(["Once upon a time", "Hello there", "Why is the sky blue?"], [sp, GREEDY, GREEDY], use_tqdm=False)[0].outputs[0].text
    assert a == b


def test_logprobs_returned(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top is not None and lp.top[0][0] == tok  # greedy: the sampled token is the top one


def test_text_prompt_empty_is_refused(llm):
    from conveyor import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], GREEDY, use_tqdm=False)
