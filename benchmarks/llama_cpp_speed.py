"""llama.cpp on the CPU speed workload, for comparison with benchmarks/cpu_speed.py.

The same random-weight 134M Llama (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab
32000, seed 0, built by cpu_speed.py's `build_random_llama`) is written to GGUF here, with the
gguf package: the weights in F32 (the float32 comparison) or Q8_0 (llama.cpp's 8-bit format, the
counterpart of conveyor's `quantization="int8"`), Q/K rows permuted as llama.cpp's converter
does, and a placeholder SentencePiece vocabulary (the prompts are token ids). It then runs the
workload through llama.cpp's C API (`llama-cpp-python`'s low-level bindings): 64 requests of 128
random prompt tokens and 64 greedy output tokens, up to `--parallel` sequences at once in one
KV cache; every step is one `llama_decode` batch holding each running sequence's next token and
the prompts of sequences joining (the batched mode of `llama-server -np N`). Then batch-1 decode.

    python benchmarks/llama_cpp_speed.py                 # F32, 64 parallel sequences
    python benchmarks/llama_cpp_speed.py --parallel 16   # the best parallelism of the issue's run
    python benchmarks/llama_cpp_speed.py --type q8_0
    python benchmarks/llama_cpp_speed.py --model smollm2 --type q8_0

With `--model smollm2` the model is the embedded SmolLM2-135M: its Q4_1 GGUF requantized by
llama.cpp's own `llama_model_quantize` to F32 or Q8_0 (conveyor also loads the Q4_1 file and
computes on its dequantized values, so both start from the same weights), with the prompts of
`cpu_speed.py --model smollm2`.

It needs `llama-cpp-python`, which builds llama.cpp from source (about 15 minutes on a 2-core
machine): `pip install --no-deps llama-cpp-python diskcache`. Without it the script says so and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_speed import build_random_llama


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's half-split rotary layout of Q/K rows -> llama.cpp's interleaved one."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_folder: Path, out: Path, tensor_type: str) -> Path:
    """The HF Llama in `hf_folder` as a llama.cpp GGUF file with a placeholder vocabulary."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("conveyor-random-134m")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}[tensor_type]
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if tensor_type == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0)

    vocab = cfg["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if name in names:
            target = names[name]
        else:
            _, _, index, *rest = name.split(".")
            module = ".".join(rest[:-1])
            target = f"blk.{index}.{layer[module]}.{rest[-1]}"
            if module == "self_attn.q_proj":
                data = rope_permute(data, heads)
            elif module == "self_attn.k_proj":
                data = rope_permute(data, kv_heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def requantize_smollm2(out: Path, tensor_type: str, threads: int) -> Path:
    """The embedded SmolLM2 GGUF (Q4_1) rewritten by llama.cpp to F32 or Q8_0."""
    import ctypes

    import llama_cpp as lc

    from conveyor.models.loader import resolve_model_path

    params = lc.llama_model_quantize_default_params()
    params.ftype = {"f32": lc.LLAMA_FTYPE_ALL_F32, "q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0}[tensor_type]
    params.allow_requantize = True
    params.nthread = threads
    source = str(resolve_model_path(None)).encode()
    if lc.llama_model_quantize(source, str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {source!r} to {tensor_type}")
    return out


class LlamaCpp:
    """One llama.cpp model and context holding `parallel` sequences."""

    def __init__(self, path: Path, parallel: int, context_per_seq: int, threads: int, batch: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)  # kept alive: C holds it
        lc.llama_log_set(self._quiet, None)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = parallel * context_per_seq
        cparams.n_batch = batch
        cparams.n_ubatch = batch
        cparams.n_seq_max = parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.capacity = batch
        self.batch = lc.llama_batch_init(batch, 0, 1)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One `llama_decode` over (token, position, sequence, wants_logits) items; the logits of
        the flagged items, in order, as `[n, vocab]`."""
        b = self.batch
        b.n_tokens = len(items)
        rows = []
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
            if logits:
                rows.append(i)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = np.empty((len(rows), self.vocab), dtype=np.float32)
        for j, i in enumerate(rows):
            ptr = self.lc.llama_get_logits_ith(self.ctx, i)
            out[j] = np.ctypeslib.as_array(ptr, shape=(self.vocab,))
        return out


def run_workload(engine: LlamaCpp, prompts: list[list[int]], output_len: int, parallel: int) -> dict:
    """Continuous batching over `parallel` slots; greedy; every request makes `output_len` tokens."""
    engine.clear()
    waiting = list(range(len(prompts)))
    free_slots = list(range(parallel))
    running: dict[int, dict] = {}  # slot -> {"req", "pos", "last", "made"}
    produced = 0
    steps = 0
    t0 = time.perf_counter()
    while waiting or running:
        items: list[tuple[int, int, int, bool]] = []
        order: list[int] = []  # slot of each logits row
        for slot, r in running.items():
            items.append((r["last"], r["pos"], slot, True))
            order.append(slot)
        while waiting and free_slots and len(items) + len(prompts[waiting[0]]) <= engine.capacity:
            req, slot = waiting.pop(0), free_slots.pop(0)
            engine.lc.llama_memory_seq_rm(engine.lc.llama_get_memory(engine.ctx), slot, -1, -1)
            p = prompts[req]
            items += [(tok, i, slot, i == len(p) - 1) for i, tok in enumerate(p)]
            running[slot] = {"req": req, "pos": len(p), "last": -1, "made": 0}
            order.append(slot)
        logits = engine.decode(items)
        steps += 1
        for row, slot in enumerate(order):
            r = running[slot]
            if r["last"] != -1:
                r["pos"] += 1
            r["last"] = int(logits[row].argmax())
            r["made"] += 1
            produced += 1
            if r["made"] == output_len:
                del running[slot]
                free_slots.append(slot)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": produced, "output_tok_per_s": produced / elapsed, "steps": steps}


def batch1(engine: LlamaCpp, prompt: list[int], steps: int = 128) -> float:
    """Median seconds per single-sequence decode step."""
    engine.clear()
    engine.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    token, times = 5, []
    for pos in range(len(prompt), len(prompt) + steps):
        t = time.perf_counter()
        token = int(engine.decode([(token, pos, 0, True)])[0].argmax())
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("random-134m", "smollm2"), default="random-134m")
    ap.add_argument("--type", choices=("f32", "q8_0"), default="f32")
    ap.add_argument("--parallel", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048, help="llama.cpp n_batch: tokens per llama_decode")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama.cpp is not installed: `pip install --no-deps llama-cpp-python diskcache` builds it from "
              "source (about 15 minutes on 2 cores). Nothing was measured.")
        sys.exit(2)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            path = requantize_smollm2(Path(tmp) / f"smollm2-{args.type}.gguf", args.type, args.threads)
            vocab = 49152  # SmolLM2's vocabulary, as cpu_speed.py reads it from the model
        else:
            folder = build_random_llama(Path(tmp) / "hf")
            path = write_gguf(folder, Path(tmp) / f"random-134m-{args.type}.gguf", args.type)
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)  # the same prompts as cpu_speed.py
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        engine = LlamaCpp(path, args.parallel, args.prompt_len + args.output_len + 16, args.threads, args.batch)
        run_workload(engine, prompts[:2], 4, args.parallel)  # warm-up
        assert engine.vocab == vocab, (engine.vocab, vocab)
        result = {"llama_cpp_python": llama_cpp.__version__, "model": args.model, "type": args.type,
                  "parallel": args.parallel,
                  "threads": args.threads}
        result["workload"] = run_workload(engine, prompts, args.output_len, args.parallel)
        print(f"llama.cpp {args.type}, {args.parallel} parallel: {result['workload']['output_tok_per_s']:.1f} output tok/s "
              f"({result['workload']['elapsed_s']:.1f} s, {result['workload']['steps']} steps)", flush=True)
        step = batch1(engine, prompts[0][:32])
        result["batch1_ms_per_step"] = step * 1e3
        print(f"llama.cpp {args.type} batch-1 decode: {step * 1e3:.2f} ms/step = {1 / step:.1f} tok/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
