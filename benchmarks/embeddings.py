"""Embedding throughput: `LLM.embed` against HF transformers' padded batches, side by side.

The same prompts (random token ids, lengths uniform in [--min-len, --max-len], seed 0) are
embedded by conveyor (the scheduler packs the prompts into steps of up to
max_num_batched_tokens, no padding) and by HF transformers (`model.model` over batches of
--hf-batch prompts, right-padded, with an attention mask; the last real token's hidden state),
both in float32 on the same weights, in turns (A B B A ...); the median of the rounds is
compared, and the vectors are checked to agree.

    python benchmarks/embeddings.py --num-prompts 64 --rounds 3

With --classify, the same for a sequence classifier: the model's body with a random
two-class head (`LlamaForSequenceClassification`, saved to a temporary folder), `LLM.classify`
against HF's `AutoModelForSequenceClassification` over the same padded batches (its own
last-real-token pick through `pad_token_id`, which no prompt contains); the probabilities are
checked to agree.

    python benchmarks/embeddings.py --num-prompts 64 --rounds 3 --classify --hf-batch 8

With --encoder minilm or bert-base, a random-weight BERT of all-MiniLM-L6-v2's or
bert-base's shape (saved to a temporary folder; the speed does not depend on the values)
embeds by its CLS state, against HF's `BertModel` over the same padded batches.

    python benchmarks/embeddings.py --encoder minilm --min-len 16 --max-len 256 --num-prompts 256 --hf-batch 32 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from conveyor import LLM, PoolingParams


def padded(prompts: list[list[int]], batch: int, pad: int) -> Iterator[tuple[list[list[int]], dict[str, torch.Tensor]]]:
    """HF's inputs: `batch` prompts at a time, right-padded with `pad`, with their attention mask."""
    for s in range(0, len(prompts), batch):
        group = prompts[s : s + batch]
        width = max(len(p) for p in group)
        yield group, {"input_ids": torch.tensor([p + [pad] * (width - len(p)) for p in group]),
                      "attention_mask": torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])}


@torch.no_grad()
def hf_embed(model, prompts: list[list[int]], batch: int, pad: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A causal LM's last real token's hidden state, normalized."""
    out: list[torch.Tensor] = []
    for group, inputs in padded(prompts, batch, pad):
        hidden = model.model(**inputs).last_hidden_state
        out += [torch.nn.functional.normalize(hidden[row, len(p) - 1], dim=0) for row, p in enumerate(group)]
    return out


@torch.no_grad()
def hf_classify(model, prompts: list[list[int]], batch: int, pad: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A sequence classifier's probabilities (its own pick of the last real token)."""
    return [row for _, inputs in padded(prompts, batch, pad) for row in model(**inputs).logits.softmax(dim=-1)]


def make_classifier(model: str | None, out: Path) -> str:
    """The model's body with a random two-class head, as an HF folder (pad token id 0)."""
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    from conveyor.models.loader import resolve_model_path

    path = resolve_model_path(model)
    load = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    causal = AutoModelForCausalLM.from_pretrained(str(path.parent if load else path), dtype=torch.float32, **load)
    config = causal.config
    config.architectures = ["LlamaForSequenceClassification"]
    config.id2label, config.label2id, config.pad_token_id = {0: "no", 1: "yes"}, {"no": 0, "yes": 1}, 0
    torch.manual_seed(0)
    clf = LlamaForSequenceClassification(config)
    clf.model.load_state_dict(causal.model.state_dict())
    clf.save_pretrained(out)
    return str(out)


ENCODERS = {  # (hidden, layers, heads, intermediate)
    "minilm": (384, 6, 12, 1536),  # all-MiniLM-L6-v2
    "bert-base": (768, 12, 12, 3072),  # bert-base-uncased, bge-base, e5-base
}


def make_encoder(kind: str, out: Path) -> str:
    """A random BERT of `kind`'s shape (BERT's vocabulary and 512 positions), as an HF folder."""
    from transformers import BertConfig, BertModel

    hidden, layers, heads, inner = ENCODERS[kind]
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=inner, max_position_embeddings=512)).save_pretrained(out)
    return str(out)


@torch.no_grad()
def hf_encode(model, prompts: list[list[int]], batch: int, pad: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """An encoder's CLS state, normalized."""
    return [row for _, inputs in padded(prompts, batch, pad)
            for row in torch.nn.functional.normalize(model(**inputs).last_hidden_state[:, 0], dim=-1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2 (the GGUF)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--classify", action="store_true", help="a random two-class head on the model's body")
    ap.add_argument("--encoder", choices=sorted(ENCODERS), help="a random BERT of this shape instead of --model")
    args = ap.parse_args()

    import tempfile

    model = args.model
    if args.classify:
        model = make_classifier(model, Path(tempfile.mkdtemp(prefix="conveyor-classifier-")))
    elif args.encoder:
        model = make_encoder(args.encoder, Path(tempfile.mkdtemp(prefix="conveyor-encoder-")))
    llm = LLM(model, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=512 << 20)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    low = 1 if args.classify or args.encoder else 0  # (never the pad token, 0)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_prompts)]
    tokens = sum(len(p) for p in prompts)

    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        path = Path(llm.engine.model_path or "")
        load = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        from transformers import AutoModel

        auto = AutoModelForSequenceClassification if args.classify else AutoModel if args.encoder else AutoModelForCausalLM
        hf = auto.from_pretrained(str(path.parent if load else path), dtype=torch.float32, **load).eval()

    def run_conveyor() -> tuple[float, list[torch.Tensor]]:
        t = time.perf_counter()
        if args.classify:
            got = [o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)]
        else:
            got = [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(), use_tqdm=False)]
        return time.perf_counter() - t, [torch.tensor(v) for v in got]

    systems = {"conveyor": run_conveyor}
    if hf is not None:
        for b in args.hf_batch:
            def run_hf(b: int = b) -> tuple[float, list[torch.Tensor]]:
                t = time.perf_counter()
                vecs = (hf_classify if args.classify else hf_encode if args.encoder else hf_embed)(hf, prompts, b, 0)
                return time.perf_counter() - t, vecs

            systems[f"HF batch {b}"] = run_hf
    run_conveyor()  # warm up (kernels, allocator)
    times: dict[str, list[float]] = {name: [] for name in systems}
    vectors: dict[str, list[torch.Tensor]] = {}
    order = list(systems)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            dt, vecs = systems[name]()
            times[name].append(dt)
            vectors[name] = vecs
    print(f"{args.num_prompts} prompts, {tokens} tokens (lengths {args.min_len}-{args.max_len}), "
          f"torch threads {torch.get_num_threads()}")
    print("| system | s by round | median s | prompt tok/s | its time over conveyor's | max abs diff to conveyor |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(times["conveyor"])
    for name in systems:
        med = statistics.median(times[name])
        diff = max((a - b).abs().max().item() for a, b in zip(vectors[name], vectors["conveyor"], strict=True))
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in times[name])} | {med:.2f} | {tokens / med:,.0f} | "
              f"{med / base:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
