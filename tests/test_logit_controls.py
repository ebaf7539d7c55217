"""logit_bias, allowed_token_ids, min_tokens and bad_words on a real model.

The reference is HF transformers' greedy `generate` on the same weights (float64) with a
logits processor written here from the parameters' definitions (OpenAI's and vLLM's): the
bias added to the logits, every token outside allowed_token_ids masked, and the end and the
stop token ids masked while fewer than min_tokens tokens were generated, a bad word's last
token masked where the output ends with the rest of its spelling. The greedy tokens
must be equal under every scheduling that changes how a sequence's rows reach the sampler.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams, StructuredOutputParams
from tests.schedulings import SCHEDULINGS
from tests.structured.tiny_tokenizer import with_tokenizer

EOS = 2  # the tiny models' end of sequence
VOCAB = 384


def hf_reference(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    n = len(prompt)
    stops = [EOS, *params.stop_token_ids]

    class Reference(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for token, bias in (params.logit_bias or {}).items():
                scores[0, token] += bias
            if params.allowed_token_ids is not None:
                keep = torch.zeros(scores.shape[1], dtype=torch.bool)
                keep[list(params.allowed_token_ids)] = True
                scores[0, ~keep] = float("-inf")
            if input_ids.shape[1] - n < params.min_tokens:
                scores[0, stops] = float("-inf")
            return scores

    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens, do_sample=False,
        eos_token_id=stops, pad_token_id=0, logits_processor=[Reference()],
    )
    return out[0, n:].tolist()


def random_params(rng: random.Random) -> SamplingParams:
    """A mix that makes each control decide tokens: large biases on a few ids (the end among
    them, so min_tokens has an end to hold back), small ones on many, a short allowed list."""
    kind = rng.choice(["bias", "allowed", "min_tokens", "all", "none"])
    bias: dict[int, float] | None = None
    allowed: list[int] | None = None
    min_tokens, stop_ids = 0, []
    if kind in ("bias", "all"):
        bias = {t: rng.uniform(-3, 3) for t in rng.sample(range(VOCAB), 40)}
        bias[rng.randrange(3, VOCAB)] = rng.choice([8.0, 100.0, -100.0])
    if kind in ("allowed", "all"):
        allowed = rng.sample(range(3, VOCAB), rng.randint(1, 12)) + ([EOS] if rng.random() < 0.5 else [])
    if kind in ("min_tokens", "all"):
        min_tokens = rng.randint(1, 6)
        stop_ids = [rng.randrange(3, VOCAB)]
        bias = {**(bias or {}), EOS: 30.0, stop_ids[0]: 25.0}
        if allowed is not None:
            allowed += [EOS, stop_ids[0]]
    return SamplingParams(
        max_tokens=rng.randint(6, 14), temperature=0.0, logit_bias=bias, allowed_token_ids=allowed,
        min_tokens=min_tokens, stop_token_ids=stop_ids,
    )


@pytest.fixture(scope="module")
def cases(tiny_models):
    model_dir = str(tiny_models["llama"])
    rng = random.Random(0)
    out = []
    for _ in range(14):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))]
        params = random_params(rng)
        out.append((prompt, params, hf_reference(model_dir, prompt, params)))
    return out


@SCHEDULINGS
def test_greedy_tokens_equal_hf_with_a_reference_processor(tiny_models, cases, options):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", **{"num_kv_blocks": 128, **options})
    outs = llm.generate([p for p, _, _ in cases], [s for _, s, _ in cases], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    held = [o for o, (_, s, _) in zip(outs, cases, strict=True) if s.min_tokens and o.outputs[0].finish_reason == "stop"]
    assert held, "no output ended after its min_tokens: nothing held the end back"
    for o, (_, s, _) in zip(outs, cases, strict=True):
        assert o.outputs[0].finish_reason == "length" or len(o.outputs[0].token_ids) > s.min_tokens
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def words_reference(base: type, spellings: set[tuple[int, ...]], n: int):
    class Reference(base):  # type: ignore[misc, valid-type]
        def __call__(self, input_ids, scores):
            made = input_ids[0, n:].tolist()
            for s in spellings:
                if len(s) == 1 or (len(made) >= len(s) - 1 and made[len(made) - len(s) + 1 :] == list(s[:-1])):
                    scores[0, s[-1]] = float("-inf")
            return scores

    return Reference()


@pytest.fixture(scope="module")
def word_cases(tiny_models, tmp_path_factory):
    """Prompts, the words each must not write (pieces of its own free greedy output, so the
    bans bite), and HF's greedy tokens with a processor that masks a spelling's last token
    wherever the output ends with the rest of it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    model_dir = str(with_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("words") / "llama"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    rng = random.Random(5)
    out = []
    for text in ["the cat", "hello world", "yes no", "abc xyz dogs", "12 345", "the"]:
        prompt = tok.encode(text)
        ids = torch.tensor([prompt])
        free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        at = rng.randrange(0, len(free) - 2)
        words = (tok.decode(free[at : at + 2]), tok.decode(free[at + 2 : at + 3]))
        words = tuple(w for w in words if w.strip())
        spellings = {tuple(tok.encode(p + w.lstrip(), add_special_tokens=False)) for w in words for p in ("", " ")}

        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=EOS, pad_token_id=0,
                              logits_processor=[words_reference(LogitsProcessor, spellings, len(prompt))])
        want = want[0, len(prompt):].tolist()
        out.append((prompt, words, spellings, free, want))
    assert any(free != want for *_, free, want in out), "no ban changed an output: nothing was tested"
    return model_dir, out


@SCHEDULINGS
def test_bad_words_equal_hf_with_a_reference_processor(word_cases, options):
    model_dir, cases = word_cases
    llm = LLM(model_dir, dtype="float64", **{"num_kv_blocks": 128, **options})
    params = [SamplingParams(max_tokens=16, temperature=0.0, bad_words=words) for _, words, *_ in cases]
    outs = llm.generate([prompt for prompt, *_ in cases], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    for o, (_, _, spellings, _, _) in zip(outs, cases, strict=True):
        made = o.outputs[0].token_ids
        assert not any(tuple(made[i : i + len(s)]) == s for s in spellings for i in range(len(made)))


def test_sampled_tokens_keep_to_their_request_whatever_the_batch(tiny_models):
    """At temperature 1.5, in one batch: rows limited to a list draw only from it; rows with
    a token biased -100 never draw it (its probability is below e^-90); rows with min_tokens
    never end before it, with the end biased +100; free rows are free."""
    llm = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64, block_size=4)
    rng = random.Random(3)
    prompts, params = [], []
    for i in range(40):
        prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))])
        kind = i % 4
        params.append(SamplingParams(
            max_tokens=20, temperature=1.5, seed=i,
            allowed_token_ids=rng.sample(range(3, VOCAB), 5) if kind == 0 else None,
            logit_bias={t: -100.0 for t in range(3, 200)} if kind == 1 else ({EOS: 100.0} if kind == 2 else None),
            min_tokens=rng.randint(1, 15) if kind == 2 else 0,
        ))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, params, strict=True):
        ids = o.outputs[0].token_ids
        if p.allowed_token_ids is not None:
            assert set(ids) <= set(p.allowed_token_ids)
        elif p.min_tokens:  # the end, forced as soon as it may come
            assert ids[-1] == EOS and len(ids) == p.min_tokens + 1 and EOS not in ids[:-1]
        elif p.logit_bias:
            assert not any(3 <= t < 200 for t in ids)


def test_a_grammar_wins_where_the_controls_leave_no_token(tiny_models, tmp_path):
    """allowed_token_ids with no token of the grammar, and min_tokens past the grammar's
    end: the output is still in the grammar (the row falls back to its mask)."""
    llm = LLM(str(with_tokenizer(tiny_models["llama"], tmp_path / "llama")), dtype="float64", num_kv_blocks=64)
    tok = llm.engine.tokenizer
    assert tok is not None
    cat = StructuredOutputParams(choice=("cat",))
    outs = llm.generate(["the", "the"], [
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=cat, allowed_token_ids=tok.encode("dog")),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=cat, min_tokens=5),
    ], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text == "cat" and o.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["ok", 3]}, "bad_words"),
    ],
)
def test_bad_controls_are_refused_when_built(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


@pytest.mark.parametrize("kwargs", [{"logit_bias": {VOCAB: 1.0}}, {"allowed_token_ids": [3, VOCAB + 7]}])
def test_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(tiny_models, kwargs):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert e.value.param == next(iter(kwargs))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
