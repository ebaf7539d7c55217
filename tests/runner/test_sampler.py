"""The sampler against hand-computed expectations on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.runner.sampler import Sampler, prepare
from conveyor.sampling_params import SamplingParams


def run(logits, params, seeds=None, history=None, prompt_lens=None, sampler=None):
    rows = logits.shape[0]
    gens = []
    for i in range(rows):
        s = (seeds or [None] * rows)[i]
        if s is None:
            gens.append(None)
        else:
            g = torch.Generator()
            g.manual_seed(s)
            gens.append(g)
    batch = prepare(params, prompt_lens or [0] * rows, gens, history or [[] for _ in range(rows)])
    return (sampler or Sampler(0, torch.device("cpu")))(logits, batch)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    tokens, lps = run(logits, [SamplingParams(temperature=0.0)] * 5)
    assert tokens == logits.argmax(-1).tolist()
    assert lps is None


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(4, 30)
    tokens, _ = run(logits, [SamplingParams(temperature=5.0, top_k=1)] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    tokens, _ = run(logits, [SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    # 4000 draws: each frequency within 4 standard errors of its probability
    se = (probs * (1 - probs) / 4000).sqrt()
    assert torch.all((counts - probs).abs() < 4 * se + 1e-3), counts


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(3000, -1).contiguous()
    cold, _ = run(logits, [SamplingParams(temperature=0.25)] * 3000)
    hot, _ = run(logits, [SamplingParams(temperature=4.0)] * 3000)
    assert cold.count(0) > hot.count(0) + 500


def test_top_p_never_samples_outside_the_nucleus():
    probs = torch.tensor([0.45, 0.35, 0.1, 0.06, 0.04])
    logits = probs.log().expand(2000, -1).contiguous()
    tokens, _ = run(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 2000)
    assert set(tokens) <= {0, 1}  # 0.45 + 0.35 reaches 0.8
    assert {0, 1} <= set(tokens)


def test_top_k_never_samples_outside():
    logits = torch.randn(1, 100).expand(2000, -1).contiguous()
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens, _ = run(logits, [SamplingParams(temperature=2.0, top_k=3)] * 2000)
    assert set(tokens) == allowed


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    logits = probs.log().expand(2000, -1).contiguous()
    tokens, _ = run(logits, [SamplingParams(temperature=1.0, min_p=0.2)] * 2000)
    assert set(tokens) == {0, 1}  # 0.07 < 0.2 * 0.6 <= 0.3


def test_seed_gives_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    row = torch.randn(1, 64)
    alone, _ = run(row, [SamplingParams(temperature=1.0, seed=7)], seeds=[7])
    crowd = torch.cat([torch.randn(3, 64), row, torch.randn(2, 64)])
    params = [SamplingParams(temperature=1.0)] * 3 + [SamplingParams(temperature=1.0, seed=7)] + [
        SamplingParams(temperature=1.0)
    ] * 2
    mixed, _ = run(crowd, params, seeds=[None, None, None, 7, None, None])
    assert mixed[3] == alone[0]


def test_different_seeds_differ_somewhere():
    row = torch.zeros(1, 1000)  # uniform: two seeds agreeing 20 times in a row is ~1e-60
    a = [run(row, [SamplingParams(seed=1)], seeds=[1 + 100 * i])[0][0] for i in range(20)]
    b = [run(row, [SamplingParams(seed=2)], seeds=[2 + 100 * i])[0][0] for i in range(20)]
    assert a != b


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.9, -0.1]])
    # token 0 seen: 2.0 / 2 = 1.0 < 1.9, so greedy moves to token 2
    tokens, _ = run(logits, [SamplingParams(temperature=0.0, repetition_penalty=2.0)], history=[[0]])
    assert tokens == [2]
    # token 3 seen and negative: -0.1 * 2 = -0.2 (still above -2.0); argmax unchanged
    tokens, _ = run(logits, [SamplingParams(temperature=0.0, repetition_penalty=2.0)], history=[[3]])
    assert tokens == [0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.0)
    # token 0 appears twice in the output: 3.0 - 0.6 = 2.4 < 2.5
    tokens, _ = run(logits, [params], history=[[9, 0, 0]], prompt_lens=[1])
    assert tokens == [1]
    # the same tokens in the prompt do not count
    tokens, _ = run(logits, [params], history=[[0, 0, 9]], prompt_lens=[2])
    assert tokens == [0]
    presence = SamplingParams(temperature=0.0, presence_penalty=0.6)
    tokens, _ = run(logits, [presence], history=[[0]], prompt_lens=[0])
    assert tokens == [1]


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(2, 20)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, logprobs=0)]
    tokens, lps = run(logits, params)
    expected = torch.log_softmax(logits, -1)
    assert lps is not None
    for row in range(2):
        assert math.isclose(lps[row][0], expected[row, tokens[row]].item(), rel_tol=1e-5)
    top = lps[0][1]
    assert top is not None and [t for t, _ in top] == expected[0].topk(3).indices.tolist()
    assert lps[1][1] is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"logprobs": 50},
        {"stop": [""]},
        {"seed": 2**70},
    ],
)
def test_bad_parameters_are_refused_with_their_name(kwargs):
    from conveyor.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == next(iter(kwargs))
    assert next(iter(kwargs)) in str(err.value)
