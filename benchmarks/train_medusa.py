"""Train Medusa heads for SmolLM2-135M-Instruct on this CPU, from SmolLM2's own greedy answers,
and save them as a checkpoint `speculative_method="medusa"` loads.

No Medusa heads for SmolLM2 are published, and nothing can be downloaded here, so the heads
conveyor's Medusa path is measured with are made here (Medusa-1's recipe, Cai et al. 2024, at
toy scale: the model frozen, the heads trained on its own outputs):

1. data: SmolLM2's greedy answers to instructions from benchmarks/train_eagle.py's templates and
   topics (the benchmark's topics kept out), a quarter followed by a request to repeat, rewrite
   or summarize one of its answers;
2. features: one pass of the model over each conversation keeps its last hidden state (after
   the final norm) at every position;
3. training: head j at position i learns the conversation's token i + j + 2 (the model's own,
   in its answers), over a truncated vocabulary of the most frequent answer tokens (vLLM's
   `token_map`); each head's residual block starts at zero and its LM head at the model's
   rows for those tokens (Medusa's initialization), the losses weighted 0.8^j;
4. the heads are saved in vLLM's names (`blocks.j.layers.0.*`, `lm_heads.j.weight`,
   `token_map`) with a config.json.

    python benchmarks/train_medusa.py [--prompts 480] [--heads 3] [--out results/medusa-smollm2]
    python benchmarks/speculative.py --medusa results/medusa-smollm2 --medusa-tokens 1 2 3 --no-ngram
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import LLM


def _train_eagle():
    """benchmarks/train_eagle.py (its instructions and the model's answers to them), imported as a
    sibling: benchmarks/ is on the path of a script run from it."""
    import train_eagle

    return train_eagle


@torch.inference_mode()
def features(llm: LLM, seqs: list[tuple[list[int], list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Each conversation's (token ids, the model's last hidden states [T, h] in float16, prompt
    length)."""
    model = llm.engine.runner.model
    out = []
    for prompt, answer in seqs:
        ids = prompt + answer
        out.append((torch.tensor(ids), model.forward_sequence(ids).half(), len(prompt)))
    return out


class Heads(nn.Module):
    """K Medusa heads of one residual block each, over a draft vocabulary (`draft_ids`)."""

    def __init__(self, head_weight: torch.Tensor, draft_ids: torch.Tensor, num_heads: int) -> None:
        super().__init__()
        h = head_weight.shape[1]
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(num_heads))
        for block in self.blocks:  # (Medusa's start: the block adds nothing)
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.heads = nn.ModuleList(nn.Linear(h, len(draft_ids), bias=False) for _ in range(num_heads))
        with torch.no_grad():
            for head in self.heads:
                head.weight.copy_(head_weight[draft_ids])
        self.register_buffer("draft_ids", draft_ids.clone())

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each head's logits over the draft vocabulary for each row."""
        return [head(hidden + F.silu(block(hidden))) for block, head in zip(self.blocks, self.heads, strict=True)]

    def checkpoint(self, folder: Path, vocab_size: int) -> None:
        """vLLM's names and config; FasterDecoding's loader reads the same heads (one block each)."""
        from safetensors.torch import save_file

        t: dict[str, torch.Tensor] = {}
        for j, (block, head) in enumerate(zip(self.blocks, self.heads, strict=True)):
            t[f"blocks.{j}.layers.0.weight"] = block.weight.detach().contiguous()
            t[f"blocks.{j}.layers.0.bias"] = block.bias.detach().contiguous()
            t[f"lm_heads.{j}.weight"] = head.weight.detach().contiguous()
        t["token_map"] = self.draft_ids.clone()
        folder.mkdir(parents=True, exist_ok=True)
        save_file(t, str(folder / "model.safetensors"))
        h = self.blocks[0].weight.shape[0]
        (folder / "config.json").write_text(json.dumps({
            "model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": len(self.heads),
            "num_hidden_layers": 1, "hidden_size": h, "vocab_size": vocab_size,
            "truncated_vocab_size": len(self.draft_ids), "medusa_fc_bias": True,
        }, indent=2))


def rows_of(data: list, num_heads: int, to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every answer position's hidden state [N, h] and its K targets [N, K] as draft ids (-100:
    past the end; -1: a token outside the draft vocabulary, no loss but a miss)."""
    xs, ys = [], []
    for ids, hidden, prompt_len in data:
        first, T = prompt_len - 1, len(ids)  # position prompt_len - 1 gave the answer's first token
        if T - first < 2:
            continue
        pos = torch.arange(first, T - 1)
        target = torch.full((len(pos), num_heads), -100, dtype=torch.long)
        for j in range(num_heads):
            at = pos + j + 2
            ok = at < T
            target[ok, j] = to_draft[ids[at[ok]]].clamp(min=-1)
        xs.append(hidden[first : T - 1])
        ys.append(target)
    return torch.cat(xs), torch.cat(ys)


def accuracy(heads: Heads, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    with torch.no_grad():
        out = heads(x.float())
    return [float(((o.argmax(-1) == y[:, j]) & (y[:, j] >= 0)).sum() / (y[:, j] != -100).sum().clamp(min=1))
            for j, o in enumerate(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=480, help="instructions (a third more follow-ups on answers)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256, help="positions a step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/medusa-smollm2")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    te = _train_eagle()

    llm = LLM()
    model = llm.engine.runner.model
    vocab = model.arch.vocab_size
    t0 = time.perf_counter()
    first = te.answers(llm, te.instructions(args.prompts, rng), args.max_tokens)
    follow = [te.FOLLOW_UPS[i % len(te.FOLLOW_UPS)].format(p=text)
              for i, (_, _, text) in enumerate(first[: args.prompts // 3])]
    seqs = [(p, a) for p, a, _ in first + te.answers(llm, follow, args.max_tokens)]
    print(f"data: {len(seqs)} conversations, {sum(len(a) for _, a in seqs)} answer tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    data = features(llm, seqs)
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)

    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, _, prompt_len in data:
        counts += torch.bincount(ids[prompt_len:], minlength=vocab)
    draft_ids = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    print(f"draft vocabulary: {len(draft_ids)} tokens cover {counts[draft_ids].sum() / counts.sum():.1%} "
          "of the answers' tokens", flush=True)

    rng.shuffle(data)
    held = max(1, len(data) // 20)
    ex, ey = rows_of(data[:held], args.heads, to_draft)
    x, y = rows_of(data[held:], args.heads, to_draft)
    head_weight = model.head_weight.detach().float()
    heads = Heads(head_weight, draft_ids, args.heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = -(-len(x) // args.batch)
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    def report() -> str:
        return ", ".join(f"head {j + 1} {a:.1%}" for j, a in enumerate(accuracy(heads, ex, ey)))

    print(f"{len(x)} training positions; held out ({held} conversations, {len(ex)} positions) before "
          f"training: {report()}", flush=True)
    weights = [0.8**j for j in range(args.heads)]
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x))
        for s in range(steps_per_epoch):
            idx = order[s * args.batch : (s + 1) * args.batch]
            out = heads(x[idx].float())
            loss = sum(w * F.cross_entropy(o, y[idx, j].where(y[idx, j] >= 0, -100),
                                           ignore_index=-100, reduction="sum") / max(1, int((y[idx, j] >= 0).sum()))
                       for j, (w, o) in enumerate(zip(weights, out, strict=True)))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            sched.step()
        print(f"epoch {epoch + 1} ({time.perf_counter() - t0:.0f} s): held out {report()}", flush=True)
    heads.checkpoint(Path(args.out), vocab)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
