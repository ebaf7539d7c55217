"""benchmarks/train_medusa.py's heads are the engine's: the heads it trains, saved in vLLM's names
with a truncated vocabulary and loaded by `speculative_method="medusa"`, guess in the engine
exactly what the training module computes over the model's hidden state, every round; and its
targets are the tokens two, three, ... places after each answer position."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.bench import load_script
from tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def train_medusa():
    return load_script("train_medusa")


def test_targets_are_the_tokens_ahead_of_each_answer_position(train_medusa):
    ids = torch.arange(10, 20)  # prompt 10..13, answer 14..19
    hidden = torch.arange(10, dtype=torch.float16)[:, None].repeat(1, 4)
    to_draft = torch.full((32,), -1, dtype=torch.long)
    to_draft[10:19] = torch.arange(9)  # (token 19 is outside the draft vocabulary)
    x, y = train_medusa.rows_of([(ids, hidden, 4)], 2, to_draft)
    assert x[:, 0].tolist() == [3, 4, 5, 6, 7, 8]  # positions 3 (gave the answer's first token) .. 8
    # head 0 at position p: token p + 2; head 1: p + 3; -100 past the end, -1 outside the vocabulary
    assert y.tolist() == [[5, 6], [6, 7], [7, 8], [8, -1], [-1, -100], [-100, -100]]


def test_the_trained_heads_guess_in_the_engine_what_they_learned(train_medusa, tmp_path):
    target = build_tiny_model(tmp_path / "llama", "llama", seed=4)
    plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
    model = plain.engine.runner.model
    rng = random.Random(0)
    seqs = [([rng.randrange(3, 384) for _ in range(rng.randint(4, 12))], [rng.randrange(3, 384) for _ in range(20)])
            for _ in range(6)]
    data = train_medusa.features(plain, seqs)
    draft_ids = torch.tensor(sorted(rng.sample(range(384), 200)))
    to_draft = torch.full((384,), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    heads = train_medusa.Heads(model.head_weight.detach().float(), draft_ids, 3)
    x, y = train_medusa.rows_of(data, 3, to_draft)
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    for _ in range(3):  # a few steps: weights no longer the init's
        loss = sum(torch.nn.functional.cross_entropy(o, y[:, j].where(y[:, j] >= 0, -100), ignore_index=-100)
                   for j, o in enumerate(heads(x.float())))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # blocks far from zero, so that each head's guess depends on its block
        g = torch.Generator().manual_seed(2)
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (p.std() + 0.1))
    folder = tmp_path / "heads"
    heads.checkpoint(folder, 384)

    llm = LLM(str(target), dtype="float64", speculative_method="medusa", speculative_model=str(folder),
              num_speculative_tokens=3, num_kv_blocks=64, block_size=8)
    rounds: list[tuple[list[int], list[int]]] = []
    fill = llm.engine.drafter.fill

    def recorded(out):
        fill(out)
        rounds.extend((list(it.all_token_ids[: it.start_pos]), list(it.token_ids[1:]))
                      for it in out.scheduled if it.num_draft)

    llm.engine.drafter.fill = recorded
    prompts = [p for p, _ in seqs[:3]]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(rounds) >= 6
    heads = heads.double()
    with torch.no_grad():
        for tokens, guesses in rounds:
            h = model.forward_sequence(tokens)[-1]
            want = [int(draft_ids[int(o.argmax())]) for o in heads(h[None])][: len(guesses)]
            assert guesses == want
