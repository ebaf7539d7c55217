"""benchmarks/train_eagle.py's head is the engine's: the head it trains (its attention unrolled
over guesses, "training-time test"), saved and loaded by `speculative_method="eagle3"`, guesses
in the engine exactly what the training module computes for the same tokens, every guess of
every round (so training teaches the head what it will be asked when it drafts)."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.bench import load_script
from tests.conftest import build_tiny_model

LAYERS = 4


@pytest.fixture(scope="module")
def train_eagle():
    return load_script("train_eagle")


def test_the_trained_head_guesses_in_the_engine_what_it_learned(train_eagle, tmp_path):
    target = build_tiny_model(tmp_path / "llama", "llama", seed=4, num_hidden_layers=LAYERS)
    plain = LLM(str(target), num_kv_blocks=64, block_size=8)
    model = plain.engine.runner.model
    aux = (2, LAYERS // 2, LAYERS - 3)
    rng = random.Random(0)
    seqs = [([rng.randrange(3, 384) for _ in range(rng.randint(4, 12))], [rng.randrange(3, 384) for _ in range(20)])
            for _ in range(6)]
    data = train_eagle.features(plain, seqs, aux)
    draft_ids = torch.tensor(sorted(rng.sample(range(384), 200)))
    to_draft = torch.full((384,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    head = train_eagle.Head(model, 3 * model.arch.hidden_size, draft_ids, LAYERS - 3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for batch in train_eagle.batches(data, 3, random.Random(1)):  # a few steps: weights no longer the init's
        losses, _ = train_eagle.step_losses(head, batch, to_draft, 3)
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
    with torch.no_grad():  # weights far from the init's (whose guesses barely depend on their inputs)
        g = torch.Generator().manual_seed(2)
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (p.std() + 0.1))
    folder = tmp_path / "head"
    head.checkpoint(aux, draft_ids, model.arch, folder)

    llm = LLM(str(target), speculative_method="eagle3", speculative_model=str(folder), num_speculative_tokens=3,
              num_kv_blocks=64, block_size=8)
    rounds: dict[int, list[tuple[int, list[int]]]] = {}
    after = llm.engine.drafter._after

    def record(it, guesses):
        rounds.setdefault(it.seq_id, []).append((it.start_pos + 1, list(guesses)))
        return after(it, guesses)

    llm.engine.drafter._after = record
    prompts = [p for p, _ in seqs[:3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    checked = 0
    for seq_id, out in zip(sorted(rounds), outs, strict=True):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        for known, guesses in rounds[seq_id]:
            # Guess k of the round reads guess k - 1 as its token: the training module, fed the
            # known tokens then the guesses, computes all three at the row before the last known.
            fed = tokens[:known] + guesses
            (ids, streams, _, _), = train_eagle.features(plain, [(fed, [])], aux)
            with torch.no_grad():
                logits = head(streams.float()[None], ids[None], 3)
            want = [int(draft_ids[step[0, known - 2].argmax()]) for step in logits][: len(guesses)]
            assert guesses == want, (seq_id, known)
            checked += 1
    assert checked >= 9
    assert len({g for rs in rounds.values() for _, gs in rs for g in gs}) > 5  # guesses that vary
