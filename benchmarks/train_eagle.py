"""Train an EAGLE-3 head for SmolLM2-135M-Instruct on this CPU, from SmolLM2's own greedy
answers, and save it as a checkpoint `speculative_method="eagle3"` loads.

No EAGLE head for SmolLM2 is published, and nothing can be downloaded here, so the head that
conveyor's EAGLE path is measured with is made here (EAGLE-3's recipe, Li et al. 2025, at toy
scale):

1. data: SmolLM2 answers instructions made from templates and topics, greedily, with conveyor
   (the topics of benchmarks/speculative.py's open questions are kept out: bicycles,
   lighthouses, languages, autumn, bees, rain, cooking); a quarter of the conversations then
   ask it to repeat, rewrite or summarize one of its own answers;
2. features: one pass of the model over each conversation keeps the residual streams entering
   layers 2, L/2 and L-3 (what the head reads) and the model's greedy token at every position
   (what it learns to guess);
3. training: the head (`fc`, one Llama layer whose attention reads the embedding and the state
   side by side, a norm and an LM head over the most frequent answer tokens) is unrolled over
   `--steps` guesses a row ("training-time test": guess k reads guess k-1's output, and attends
   to the rows fed from the model plus its own earlier guesses at that row, as it will when it
   drafts), trained with a cross-entropy on the model's tokens of the answers;
4. the head is saved in SafeAILab's names (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
   `t2d`) with its config.json.

    python benchmarks/train_eagle.py [--prompts 480] [--epochs 3] [--out results/eagle3-smollm2]
    python benchmarks/speculative.py --eagle results/eagle3-smollm2 --no-ngram
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

from conveyor import LLM, SamplingParams

TEMPLATES = [
    "Explain {x} in simple terms.", "Write a short paragraph about {x}.", "What are the main benefits of {x}?",
    "Give three tips about {x}.", "Describe {x} to a ten-year-old.", "What is the history of {x}?",
    "Write a short story that involves {x}.", "List five facts about {x}.", "Why do people care about {x}?",
    "Write a haiku about {x}.", "What are common mistakes people make with {x}?", "How would you teach {x}?",
    "Compare {x} with something similar.", "Write a friendly email inviting a colleague to learn about {x}.",
    "What questions should a beginner ask about {x}?", "Summarize the key ideas behind {x}.",
    "What are the risks of {x}?", "Write a product description for a book about {x}.",
    "How has {x} changed over the last fifty years?", "Give a step-by-step guide to getting started with {x}.",
    "Write a poem about {x}.", "What would the world be like without {x}?", "Tell me a fun fact about {x}.",
    "Write a dialogue between two friends talking about {x}.", "What is the science behind {x}?",
    "Give me a short quiz about {x} with answers.", "Why is {x} important for children to learn about?",
    "Write a news headline and a short article about {x}.", "What are the pros and cons of {x}?",
    "Explain {x} as if you were a teacher.", "How can someone get better at understanding {x}?",
    "Describe a day in the life of someone who works with {x}.", "What myths do people believe about {x}?",
    "Write a short speech about {x}.", "What are three surprising things about {x}?",
    "How does {x} affect the environment?", "Write a limerick about {x}.", "Give advice to a student writing an essay about {x}.",
    "What is the future of {x}?", "Answer briefly: what is {x}?",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "public libraries", "electric cars", "gardening",
    "chess", "the moon landing", "recycling", "meditation", "the internet", "coffee", "rainforests",
    "the printing press", "jazz music", "saving money", "vaccines", "solar power", "the Roman Empire",
    "bread baking", "marathon running", "black holes", "the human heart", "earthquakes", "mountain climbing",
    "video games", "time management", "the French Revolution", "origami", "sleep", "dinosaurs", "wind turbines",
    "public speaking", "the stock market", "penguins", "tea ceremonies", "3D printing", "the Olympic Games",
    "clouds", "friendship", "museums", "machine learning", "plastic pollution", "the piano", "coral reefs",
    "democracy", "camping", "spreadsheets", "the immune system", "trains", "poetry", "kindness", "deserts",
    "the alphabet", "board games", "ocean tides", "writing a resume", "composting",
    "thunderstorms", "the periodic table", "ancient Egypt", "cats",
    "dogs", "healthy breakfasts", "the solar system", "volunteering", "smartphones", "the Great Wall of China",
    "birds migrating", "making friends at a new school", "rivers", "the violin", "the Arctic",
    "electricity", "recycling paper", "the first airplanes", "robots", "yoga", "snow", "bridges", "maps", "space travel", "the ocean floor", "honesty", "farming",
    "the brain", "handwriting", "pizza", "castles", "vitamins", "butterflies", "the desert", "trees",
]
FOLLOW_UPS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Rewrite the following text more clearly:\n\n{p}",
    "Summarize the following text in two sentences:\n\n{p}",
]


def instructions(n: int, rng: random.Random) -> list[str]:
    combos = [t.format(x=x) for t in TEMPLATES for x in TOPICS]
    rng.shuffle(combos)
    return combos[:n]


def answers(llm: LLM, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int], str]]:
    """(prompt token ids, the model's greedy answer's ids, its text) for each chat prompt."""
    convs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@torch.inference_mode()
def features(llm: LLM, seqs: list[tuple[list[int], list[int]]], aux: tuple[int, ...]
             ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Each conversation's (token ids, streams entering the `aux` layers [T, 3h] in float16,
    the model's greedy token at each position, prompt length)."""
    model = llm.engine.runner.model
    model.aux_layers = aux
    out = []
    try:
        for prompt, answer in seqs:
            ids = prompt + answer
            hidden = model.forward_sequence(ids)
            labels = model.compute_logits(hidden).argmax(dim=-1)
            out.append((torch.tensor(ids), model.aux_hidden.half(), labels, len(prompt)))
    finally:
        model.aux_layers = ()
    return out


def weight_of(linear: nn.Module) -> torch.Tensor:
    """A projection's weight `[out, in]` (the CPU path may keep it transposed)."""
    w = linear.weight if hasattr(linear, "weight") else linear.weight_t.t()
    return w.detach().float()


class Head(nn.Module):
    """EAGLE-3's draft layer, written out for training (its attention unrolled over guesses)."""

    def __init__(self, model, aux_width: int, draft_ids: torch.Tensor, init_layer: int) -> None:
        super().__init__()
        arch = model.arch
        h, d = arch.hidden_size, arch.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = arch.num_heads, arch.num_kv_heads, d, arch.rms_norm_eps
        self.embed = model.embed_tokens.weight.detach().float()  # the model's, frozen (not saved)
        inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)
        src = model.layers[init_layer]  # a start: the layer whose incoming stream fc first passes on
        q_rows, kv_rows = arch.num_heads * d, arch.num_kv_heads * d
        qkv = weight_of(src.self_attn.qkv_proj)
        gate_up = weight_of(src.mlp.gate_up_proj)
        ff = arch.intermediate_size

        def lin(weight: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(weight.clone())

        def wide(weight: torch.Tensor) -> nn.Parameter:  # [rows, h] -> [rows, 2h]: the embedding's half at 0
            return nn.Parameter(torch.cat((torch.zeros_like(weight), weight), dim=1))

        self.fc = nn.Parameter(torch.cat((torch.zeros(h, aux_width - h), torch.eye(h)), dim=1))
        self.q = wide(qkv[:q_rows])
        self.k = wide(qkv[q_rows : q_rows + kv_rows])
        self.v = wide(qkv[q_rows + kv_rows :])
        self.o = lin(weight_of(src.self_attn.o_proj))
        self.gate, self.up = lin(gate_up[:ff]), lin(gate_up[ff:])
        self.down = lin(weight_of(src.mlp.down_proj))
        self.input_norm = lin(src.input_layernorm.weight.detach().float())
        self.hidden_norm = lin(src.input_layernorm.weight.detach().float())
        self.post_norm = lin(src.post_attention_layernorm.weight.detach().float())
        self.norm = lin(model.norm.weight.detach().float())
        self.lm_head = lin(model.head_weight.detach().float()[draft_ids])

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None]
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Logits `[B, n, draft vocab]` of each guess k = 1..steps for rows 0..n-1 (n = T - 1):
        guess k of row i sits at position i + k - 1, reads token i + k, and guesses the model's
        token after it (at position i + k)."""
        B, T, _ = aux.shape
        n = T - 1
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        hidden = aux[:, :n] @ self.fc.T
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        scale = d**-0.5
        for k in range(1, steps + 1):
            at = (torch.arange(n) + k).clamp(max=T - 1)
            positions = torch.arange(n) + k - 1
            x = torch.cat((self.rms(self.embed[tokens[:, at]], self.input_norm), self.rms(hidden, self.hidden_norm)), -1)
            q = self.rope((x @ self.q.T).view(B, n, H, d).transpose(1, 2), positions)
            key = self.rope((x @ self.k.T).view(B, n, KV, d).transpose(1, 2), positions)
            value = (x @ self.v.T).view(B, n, KV, d).transpose(1, 2)
            keys.append(key.repeat_interleave(H // KV, dim=1))
            values.append(value.repeat_interleave(H // KV, dim=1))
            scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            scores += [(q * keys[j]).sum(-1, keepdim=True) * scale for j in range(1, k)]  # its own row's earlier guesses
            p = torch.cat(scores, dim=-1).softmax(dim=-1)
            o = p[..., :n] @ values[0]
            for j in range(1, k):
                o = o + p[..., n + j - 1 : n + j] * values[j]
            r = hidden + o.transpose(1, 2).reshape(B, n, H * d) @ self.o.T
            m = self.rms(r, self.post_norm)
            hidden = r + (F.silu(m @ self.gate.T) * (m @ self.up.T)) @ self.down.T
            out.append(self.rms(hidden, self.norm) @ self.lm_head.T)
        return out

    def checkpoint(self, aux: tuple[int, ...], draft_ids: torch.Tensor, arch, folder: Path) -> None:
        """SafeAILab's EAGLE-3 names and config."""
        from safetensors.torch import save_file

        vocab = arch.vocab_size
        t = {
            "fc.weight": self.fc, "midlayer.self_attn.q_proj.weight": self.q, "midlayer.self_attn.k_proj.weight": self.k,
            "midlayer.self_attn.v_proj.weight": self.v, "midlayer.self_attn.o_proj.weight": self.o,
            "midlayer.mlp.gate_proj.weight": self.gate, "midlayer.mlp.up_proj.weight": self.up,
            "midlayer.mlp.down_proj.weight": self.down, "midlayer.input_layernorm.weight": self.input_norm,
            "midlayer.hidden_norm.weight": self.hidden_norm, "midlayer.post_attention_layernorm.weight": self.post_norm,
            "norm.weight": self.norm, "lm_head.weight": self.lm_head,
        }
        tensors = {k: v.detach().contiguous() for k, v in t.items()}
        tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"))
        cfg = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_attention_heads": arch.num_heads,
            "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta, "vocab_size": vocab,
            "draft_vocab_size": len(draft_ids), "max_position_embeddings": arch.max_position_embeddings,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
        }
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))


def batches(data: list, size: int, rng: random.Random | None) -> list[list]:
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))  # similar lengths together (less padding)
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    if rng is not None:
        rng.shuffle(groups)
    return [[data[i] for i in g] for g in groups]


def tensors_of(batch: list, to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (streams, tokens, draft-vocabulary labels: -100 where no loss is taken)."""
    T = max(len(ids) for ids, _, _, _ in batch)
    width = batch[0][1].shape[1]
    aux = torch.zeros(len(batch), T, width)
    tokens = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    for b, (ids, streams, greedy, prompt_len) in enumerate(batch):
        n = len(ids)
        aux[b, :n], tokens[b, :n] = streams.float(), ids
        lab = to_draft[greedy]
        lab[: prompt_len - 1] = -100  # the answers' tokens only (the first one is the prefill's, never a guess)
        labels[b, :n] = lab
    return aux, tokens, labels


def step_losses(head: Head, batch: list, to_draft: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    aux, tokens, labels = tensors_of(batch, to_draft)
    T = tokens.shape[1]
    losses, hits = [], []
    for k, logits in enumerate(head(aux, tokens, steps), start=1):
        at = torch.arange(T - 1) + k
        lab = torch.where(at < T, labels[:, at.clamp(max=T - 1)], -100)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100))
        keep = lab >= 0
        hits.append((int((logits.argmax(-1) == lab)[keep].sum()), int(keep.sum())))
    return losses, hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=480, help="instructions (a third more follow-ups on answers)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="guesses a row is unrolled over in training")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/eagle3-smollm2")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)

    llm = LLM()
    arch = llm.engine.runner.model.arch
    L = arch.num_layers
    aux = (2, L // 2, L - 3)
    t0 = time.perf_counter()
    first = answers(llm, instructions(args.prompts, rng), args.max_tokens)
    follow = [FOLLOW_UPS[i % len(FOLLOW_UPS)].format(p=text) for i, (_, _, text) in enumerate(first[: args.prompts // 3])]
    seqs = [(p, a) for p, a, _ in first + answers(llm, follow, args.max_tokens)]
    n_answer = sum(len(a) for _, a in seqs)
    print(f"data: {len(seqs)} conversations, {n_answer} answer tokens, {sum(len(p) for p, _ in seqs)} prompt tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    data = features(llm, seqs, aux)
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)

    counts = torch.zeros(arch.vocab_size, dtype=torch.long)
    for _, _, greedy, prompt_len in data:
        counts += torch.bincount(greedy[prompt_len - 1 :], minlength=arch.vocab_size)
    draft_ids = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    to_draft = torch.full((arch.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    print(f"draft vocabulary: {len(draft_ids)} tokens cover {counts[draft_ids].sum() / counts.sum():.1%} "
          "of the answers' tokens", flush=True)

    rng.shuffle(data)
    held = max(1, len(data) // 20)
    evaluation, training = data[:held], data[held:]
    head = Head(llm.engine.runner.model, len(aux) * arch.hidden_size, draft_ids, L - 3)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(batches(training, args.batch, None))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    def evaluate() -> str:
        with torch.no_grad():
            sums = [[0, 0] for _ in range(args.steps)]
            for batch in batches(evaluation, args.batch, None):
                for k, (hit, n) in enumerate(step_losses(head, batch, to_draft, args.steps)[1]):
                    sums[k][0] += hit
                    sums[k][1] += n
        return ", ".join(f"guess {k + 1} {h / max(n, 1):.1%}" for k, (h, n) in enumerate(sums))

    print(f"held out ({len(evaluation)} conversations) before training: {evaluate()}", flush=True)
    t0 = time.perf_counter()
    weights = [0.8**k for k in range(args.steps)]
    for epoch in range(args.epochs):
        running = 0.0
        for i, batch in enumerate(batches(training, args.batch, rng)):
            losses, _ = step_losses(head, batch, to_draft, args.steps)
            loss = sum(w * x for w, x in zip(weights, losses, strict=True))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            running += float(loss.detach())  # type: ignore[union-attr]
            if i % 20 == 19:
                print(f"  epoch {epoch + 1} batch {i + 1}: loss {running / 20:.3f} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
                running = 0.0
        print(f"epoch {epoch + 1} ({time.perf_counter() - t0:.0f} s): held out {evaluate()}", flush=True)
    head.checkpoint(aux, draft_ids, arch, Path(args.out))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
