"""Beam search (`LLM.beam_search`) against a beam search written here over HF transformers.

The reference runs HF's model in float64 over each beam's whole sequence every round (no
cache), takes the top 2 * beam_width next tokens of each beam, and keeps the best beam_width by
`cum_logprob / length ** length_penalty`: the rule conveyor/beam_search.py states, written
again independently. conveyor's rounds run as batched one-token requests over the prefix cache,
under every scheduling; they must find the same beams. A frequent token made the end token
exercises completed beams on the tiny model; SmolLM2 ends its answers with its own.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.beam_search import BeamSearch, BeamSearchParams, beam_score

VOCAB = 384


def reference(model, prompt: list[int], params: BeamSearchParams, eos: set[int]):  # type: ignore[no-untyped-def]
    beams: list[tuple[list[int], float, bool]] = [([], 0.0, False)]
    done: list[tuple[list[int], float, bool]] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            if not beams:
                break
            grown = []
            for out, cum, _ in beams:
                logits = model(torch.tensor([prompt + out])).logits[0, -1]
                vals, ids = torch.log_softmax(logits.double(), dim=-1).topk(2 * params.beam_width)
                for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
                    ends = t in eos and not params.ignore_eos
                    (done if ends else grown).append(([*out, t], cum + v, ends))

            def score(b: tuple[list[int], float, bool]) -> float:
                return beam_score(len(b[0]), b[1], b[2], params.length_penalty)

            beams = sorted(grown, key=lambda b: -score(b))[: params.beam_width]
    return sorted(done + beams, key=lambda b: -beam_score(len(b[0]), b[1], b[2], params.length_penalty))[
        : params.beam_width]


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def eos(hf, prompts) -> set[int]:
    """The end token, and the token most often among the top 3 along the prompts' greedy paths
    (made an end token too, so that beams complete along the way)."""
    seen: dict[int, int] = {}
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(6):
                top = hf(torch.tensor([seq])).logits[0, -1].topk(3).indices.tolist()
                for t in top:
                    seen[t] = seen.get(t, 0) + 1
                seq.append(top[0])
    return {2, max(seen, key=lambda t: seen[t])}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(9)]
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)] + [
        [*shared, rng.randrange(3, VOCAB)] for _ in range(2)]


def check(got, want) -> None:  # type: ignore[no-untyped-def]
    assert len(got.sequences) == len(want)
    for seq, (tokens, cum, ends) in zip(got.sequences, want, strict=True):
        assert seq.output_token_ids == tokens
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
        assert seq.finished == ends
        assert sum(seq.logprobs) == pytest.approx(seq.cum_logprob, abs=1e-9)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8, "block_size": 4},  # beams' prefixes in chunks
        {"num_kv_blocks": 10, "block_size": 4},  # more beams than the cache holds at once
        {"async_scheduling": True},
    ],
    ids=["default", "no-prefix-cache", "chunked-8", "small-cache", "async"],
)
@pytest.mark.parametrize("width,penalty", [(1, 1.0), (3, 1.0), (4, 0.0)])
def test_beams_equal_a_reference_over_hf(tiny_models, hf, prompts, eos, options, width, penalty):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", **{"num_kv_blocks": 256, **options})
    llm.engine.scheduler.eos_token_ids = frozenset(eos)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty)
    outs = llm.beam_search(prompts, params)
    finished = 0
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference(hf, prompt, params, eos)
        check(out, want)
        finished += sum(s.finished for s in out.sequences)
        for seq in out.sequences:
            assert seq.tokens[: len(prompt)] == prompt
    if width > 1:
        assert finished  # (the test reaches completed beams)


def test_width_one_is_greedy_decoding(tiny_models, prompts):
    llm = LLM(str(tiny_models["llama"]), dtype="float64")
    beams = llm.beam_search(prompts, BeamSearchParams(1, 10, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [b.sequences[0].output_token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_ignore_eos(tiny_models, hf, prompts, eos):
    llm = LLM(str(tiny_models["llama"]), dtype="float64")
    llm.engine.scheduler.eos_token_ids = frozenset(eos)
    params = BeamSearchParams(3, 5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.beam_search(prompts, params), strict=True):
        check(out, reference(hf, prompt, params, eos))
        assert all(len(s.output_token_ids) == 5 and not s.finished for s in out.sequences)


def test_the_search_state_by_hand():
    search = BeamSearch([9, 9], BeamSearchParams(2, 3, length_penalty=0.0), frozenset({0}))
    search.advance([[(5, -0.1), (0, -0.2), (6, -1.0), (7, -2.0)]])
    assert [b.output_token_ids for b in search.beams] == [[5], [6]]
    assert [(c.output_token_ids, c.finished) for c in search.completed] == [([0], True)]
    search.advance([[(0, -0.05), (8, -0.5), (6, -3.0), (7, -4.0)], [(0, -0.1), (5, -0.3), (6, -3.0), (7, -4.0)]])
    # Two complete beams score -0.15 and -0.2; the best live one has -0.6 and can only fall.
    assert search.done
    best = search.result().sequences
    assert [(s.output_token_ids, s.cum_logprob) for s in best] == [([5, 0], pytest.approx(-0.15)),
                                                                   ([0], pytest.approx(-0.2))]
    assert [s.finish_reason for s in best] == ["stop", "stop"]


def test_bad_requests_are_refused_before_anything_runs(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", max_model_len=32)
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(11, 4)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        BeamSearchParams(2, 0)
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.beam_search([[5, 6], list(range(3, 33))], BeamSearchParams(2, 4))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_smollm2_beams_end_with_its_end_token(smollm2):
    """On SmolLM2, a short answer's beams end with <|im_end|>, and each beam's logprobs are the
    model's: teacher-forcing the beam's tokens gives them back (prompt logprobs)."""
    llm = LLM(smollm2, kv_cache_memory=128 << 20, max_model_len=1024)
    tok = llm.tokenizer
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    out = llm.beam_search([prompt], BeamSearchParams(3, 24))[0]
    assert out.sequences[0].finished and out.sequences[0].text
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        again = llm.generate([seq.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        forced = [e.logprob for e in again.prompt_logprobs[len(prompt):]]  # type: ignore[index]
        assert forced == pytest.approx(seq.logprobs, abs=2e-3)
