"""Compile the CUDA path's Triton kernels for an H100 (sm_90) on a machine without a GPU, and
read ptxas's registers and spills for each: what the interpreter cannot check (it runs the
kernels in Python and compiles nothing), checked before a GPU is lent.

    python benchmarks/triton_sm90.py            # GEMVs, fused and attention kernels, Llama-3.2-1B's shapes
    python benchmarks/triton_sm90.py --arch 80  # for an A100

Each kernel is launched through its own Python wrapper with CPU tensors, as the model calls it,
but the launch is only recorded; the recorded arguments give the compile's signature and
constants (what `kernel[grid](...)` would have specialised on; `num_warps` and `num_stages`
become options) and, through the JIT's own specialisation function, which ints are constants
(== 1) and which ints and pointers are multiples of 16, as a launch on a GPU would specialise
them. Triton's bundled ptxas then reports registers and spill bytes, and the PTX the width of
each global load. Exits non-zero when a kernel does not compile, when a GEMV reads its weights
in loads narrower than 16 bytes, when a float16 kernel computes in float16 (torch rounds each
op's float32 result; a compiled half FMA rounds once, one ulp off it, as an H100 showed), when a GEMV compiled for programmatic dependent launch has no
grid-dependency wait, or, with `--no-spills`, when a kernel spills. Run without TRITON_INTERPRET
(the script refuses it): the kernels must be real `triton.jit` functions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

GEMV_SHAPES = {  # Llama-3.2-1B: (N, K) of each projection, and what it folds in
    "qkv_proj (norm)": (3072, 2048, dict(norm=True)),
    "o_proj (residual)": (2048, 2048, dict(residual=True)),
    "gate_up_proj (norm)": (16384, 2048, dict(norm=True)),
    "down_proj (silu_mul, residual)": (2048, 8192, dict(silu_mul=True, residual=True)),
    "lm_head": (128256, 2048, {}),
    "lm_head (norm, argmax)": (128256, 2048, dict(norm=True, argmax=True)),  # a graphed step's head
}
H100_SMS = 132


class Recorder:
    """Stands in for a `triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextmanager
def recording(module: Any) -> Iterator[dict[str, Recorder]]:
    """Every `triton.jit` kernel of `module` replaced by a Recorder, by name."""
    import triton

    kernels = {name: k for name, k in vars(module).items() if isinstance(k, triton.runtime.jit.JITFunction)}
    recorders = {name: Recorder(k) for name, k in kernels.items()}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        yield recorders
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
         torch.int32: "*i32"}


def compile_call(kernel: Any, args: tuple, kwargs: dict, arch: int) -> Any:
    """`triton.compile` of one recorded launch for `cuda:arch`, specialised as a launch on a GPU
    would be: an int equal to 1 becomes a constant, and an int divisible by 16 or a pointer
    aligned to 16 bytes is marked so (`tt.divisibility`), which is what lets the compiler
    vectorise loads. Without those marks every load is a scalar one (a compile that no GPU
    launch would make)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, attr = specialize(CUDABackend, value, param)
        if kind == "constexpr":
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        signature[param.name] = kind
        if isinstance(attr, str):
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def specialize(backend: Any, value: Any, param: Any) -> tuple[str, Any]:
    """(type, attribute) of one argument, as the JIT's launcher computes them."""
    from triton._C.libtriton import native_specialize_impl

    return native_specialize_impl(backend, value, False, not param.do_not_specialize,
                                  not param.do_not_specialize_on_alignment)


def load_widths(ptx: str) -> dict[str, int]:
    """Global loads in the PTX by width in bits (`ld.global...v4.b32` is 128): a weight stream
    wants 128-bit loads."""
    widths: dict[str, int] = {}
    for vec, bits in re.findall(r"ld\.global[\w.:]*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        width = str(int(vec or 1) * int(bits))
        widths[width] = widths.get(width, 0) + 1
    return widths


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store bytes) from ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        suffix = "a" if arch == 90 else ""
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", "-o", os.devnull, str(path)],
                              capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0


def rounding_cases(dt: torch.dtype, suffix: str) -> Iterator[tuple[str, Any, Callable[[], None], str]]:
    """The fused element-wise kernels, a GEMV with every fold and the decode that rotates, in `dt`."""
    from conveyor.kernels import triton_attention, triton_fused, triton_gemv
    from conveyor.models.attention import build_metadata

    hidden = torch.zeros(4, 2048, dtype=dt)
    yield f"add_rms_norm{suffix}", triton_fused, lambda: triton_fused.add_rms_norm(hidden, hidden, hidden[0], 1e-5), \
        "_add_rms_norm_kernel"
    yield f"rope_{suffix}", triton_fused, lambda: triton_fused.rope_(torch.zeros(4, 40, 64, dtype=dt),
                                                                    torch.zeros(4, 1, 32, dtype=dt),
                                                                    torch.zeros(4, 1, 32, dtype=dt), 40), "_rope_kernel"
    yield f"rope + K/V write{suffix}", triton_fused, lambda: triton_fused.rope_write_kv_(
        torch.zeros(4, 48, 64, dtype=dt), torch.zeros(4, 1, 32, dtype=dt), torch.zeros(4, 1, 32, dtype=dt), 32,
        torch.zeros(2, 512, 8, 64, dtype=dt), torch.arange(4)), "_rope_write_kv_kernel"
    yield f"silu_mul{suffix}", triton_fused, lambda: triton_fused.silu_mul(torch.zeros(4, 16384, dtype=dt)), \
        "_silu_mul_kernel"
    if dt == torch.bfloat16:
        return  # the GEMVs and attention in bfloat16: cases()
    yield f"gemv down_proj (silu_mul, residual), 1 row{suffix}", triton_gemv, lambda: triton_gemv.linear(
        torch.zeros(1, 16384, dtype=dt), torch.zeros(2048, 8192, dtype=dt), norm=None, eps=1e-5, silu_mul=True,
        residual=torch.zeros(1, 2048, dtype=dt)), "_gemv_kernel"
    yield f"gemv qkv_proj (norm), 2 rows{suffix}", triton_gemv, lambda: triton_gemv.linear(
        torch.zeros(2, 2048, dtype=dt), torch.zeros(3072, 2048, dtype=dt), norm=torch.ones(2048, dtype=dt), eps=1e-5,
        silu_mul=False, residual=None), "_gemv_kernel"
    triton_attention.triton_available = lambda: True  # compiled here, never launched
    merged = triton_attention.TritonPagedAttention(None, decode_split_len=64, merge_splits=True)
    cache = torch.zeros(2, 32 * 16, 8, 64, dtype=dt)

    def rope_decodes() -> None:
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(2)]
        meta = build_metadata(tables, [100, 50], [1, 1], 16, torch.device("cpu"), None, dt)
        merged.attend_decodes_rope(torch.zeros(2, 48, 64, dtype=dt), torch.zeros(2, 1, 32, dtype=dt),
                                   torch.zeros(2, 1, 32, dtype=dt), cache, meta, 0.125)

    yield f"decode + RoPE + K/V write, merged{suffix}", triton_attention, rope_decodes, "_decode_split_kernel"


# Arithmetic in float16 itself: where the kernels round a float32 result to float16 as torch
# does, the compiler must not narrow a product and the sum after it to half precision (which it
# then contracts into one half FMA, rounding once where torch rounds twice).
HALF_ARITHMETIC = re.compile(r"^\s*(?:add|sub|mul|fma|neg|min|max)(?:\.\w+)*\.f16(?:x2)?\b", re.MULTILINE)


def cases() -> Iterator[tuple[str, Any, Callable[[], None], str]]:
    """(label, module, call, kernel name): each wrapper call whose launches are compiled."""
    from conveyor.kernels import triton_fused, triton_gemv

    dt = torch.bfloat16
    for rows, pdl in [(1, False), (2, False), (4, False), (8, False), (1, True)]:
        for label, (n, k, fold) in GEMV_SHAPES.items():
            def call(rows: int = rows, n: int = n, k: int = k, fold: dict = fold, pdl: bool = pdl) -> None:
                x = torch.zeros(rows, 2 * k if fold.get("silu_mul") else k, dtype=dt)
                if fold.get("argmax"):
                    triton_gemv.linear_argmax(x, torch.zeros(n, k, dtype=dt), norm=torch.ones(k, dtype=dt), eps=1e-5,
                                              pdl=pdl)
                    return
                triton_gemv.linear(x, torch.zeros(n, k, dtype=dt), norm=torch.ones(k, dtype=dt) if fold.get("norm") else None,
                                   eps=1e-5, silu_mul=bool(fold.get("silu_mul")),
                                   residual=torch.zeros(rows, n, dtype=dt) if fold.get("residual") else None, pdl=pdl)
            yield f"gemv {label}, {rows} row(s){', PDL' if pdl else ''}", triton_gemv, call, "_gemv_kernel"
    # The few-row path as matrix products on the tensor cores (`Config.dot`), a config the sweep times.
    for rows in (2, 8):
        def dot_call(rows: int = rows) -> None:
            triton_gemv.linear(torch.zeros(rows, 2048, dtype=dt), torch.zeros(3072, 2048, dtype=dt),
                               norm=torch.ones(2048, dtype=dt), eps=1e-5,
                               config=triton_gemv.Config(32, 256, dot=True))
        yield f"gemv qkv_proj (norm), {rows} rows, matrix products", triton_gemv, dot_call, "_gemv_kernel"
    # The kernels that round as torch rounds, in bfloat16 and float16 (each half precision its
    # own rounding: `HALF_ARITHMETIC` below).
    for dt, suffix in ((torch.bfloat16, ""), (torch.float16, ", float16")):
        yield from rounding_cases(dt, suffix)
    dt = torch.bfloat16
    logits = torch.zeros(4, 128256, dtype=torch.float32)
    yield "argmax (chunks, the last merges)", triton_fused, lambda: triton_fused.argmax(logits), "_argmax_kernel"
    # Paged attention at Llama-3.2-1B's heads (32 query, 8 kv, 64 dims), 16-token blocks: two
    # decodes split over their context (so the reduce runs too), then a prefill of 40 tokens.
    from conveyor.kernels import triton_attention
    from conveyor.models.attention import build_metadata

    triton_attention.triton_available = lambda: True  # compiled here, never launched
    backend = triton_attention.TritonPagedAttention(None, decode_split_len=64)
    cache = torch.zeros(2, 32 * 16, 8, 64, dtype=dt)

    def attend_with(attention: Any, new: list[int], starts: list[int]) -> None:
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(new))]
        meta = build_metadata(tables, starts, new, 16, torch.device("cpu"), None, dt)
        t = sum(new)
        attention.forward(torch.zeros(t, 32, 64, dtype=dt), torch.zeros(t, 8, 64, dtype=dt),
                          torch.zeros(t, 8, 64, dtype=dt), cache, meta, 0.125)

    def attend(new: list[int], starts: list[int]) -> None:
        attend_with(backend, new, starts)

    decodes = lambda: attend([1, 1], [100, 50])  # noqa: E731
    yield "write K/V", triton_attention, decodes, "_write_kv_kernel"
    yield "decode, split", triton_attention, decodes, "_decode_split_kernel"
    yield "decode, reduce", triton_attention, decodes, "_decode_reduce_kernel"
    yield "prefill", triton_attention, lambda: attend([40], [0]), "_prefill_kernel"
    # With programmatic dependent launch, the attention kernels that a GEMV follows let it
    # start early (`gdc_launch_dependents`).
    backend.pdl = True
    one_split = triton_attention.TritonPagedAttention(None, decode_split_len=1 << 20)
    one_split.pdl = True
    yield "decode, reduce, PDL", triton_attention, decodes, "_decode_reduce_kernel"
    yield "decode, one split, PDL", triton_attention, lambda: attend_with(one_split, [1], [100]), \
        "_decode_split_kernel"
    yield "prefill, PDL", triton_attention, lambda: attend([40], [0]), "_prefill_kernel"
    # The splits merged in the decode launch (no reduce launch), then with RoPE and the K/V
    # write folded in too (`attend_decodes_rope`, a decode step's attention in one launch).
    merged = triton_attention.TritonPagedAttention(None, decode_split_len=64, merge_splits=True)
    yield "decode, splits merged in the launch", triton_attention, lambda: attend_with(merged, [1, 1], [100, 50]), \
        "_decode_split_kernel"

    def rope_decodes(attention: Any) -> None:
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(2)]
        meta = build_metadata(tables, [100, 50], [1, 1], 16, torch.device("cpu"), None, dt)
        attention.attend_decodes_rope(torch.zeros(2, 48, 64, dtype=dt), torch.zeros(2, 1, 32, dtype=dt),
                                      torch.zeros(2, 1, 32, dtype=dt), cache, meta, 0.125)

    yield "decode + RoPE + K/V write, merged", triton_attention, lambda: rope_decodes(merged), "_decode_split_kernel"
    merged.pdl = True
    yield "decode + RoPE + K/V write, merged, PDL", triton_attention, lambda: rope_decodes(merged), \
        "_decode_split_kernel"
    # Gemma 2's soft-capped scores and gpt-oss's sinks (with the reduce, and merged in the launch).
    capped = triton_attention.TritonPagedAttention(None, decode_split_len=64, softcap=50.0)
    sunk = triton_attention.TritonPagedAttention(None, decode_split_len=64, merge_splits=True)
    sunk.sinks = torch.zeros(32, dtype=dt)
    yield "decode, split, soft cap", triton_attention, lambda: attend_with(capped, [1, 1], [100, 50]), \
        "_decode_split_kernel"
    yield "prefill, soft cap", triton_attention, lambda: attend_with(capped, [40], [0]), "_prefill_kernel"
    yield "decode, splits merged, sinks", triton_attention, lambda: attend_with(sunk, [1, 1], [100, 50]), \
        "_decode_split_kernel"
    sunk_reduce = triton_attention.TritonPagedAttention(None, decode_split_len=64)
    sunk_reduce.sinks = sunk.sinks
    yield "decode, reduce, sinks", triton_attention, lambda: attend_with(sunk_reduce, [1, 1], [100, 50]), \
        "_decode_reduce_kernel"
    yield "prefill, sinks", triton_attention, lambda: attend_with(sunk, [40], [0]), "_prefill_kernel"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100), 80 (A100)")
    ap.add_argument("--no-spills", action="store_true", help="exit non-zero if any kernel spills")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted", file=sys.stderr)
        return 2
    from conveyor.kernels import triton_gemv

    triton_gemv._programs_wanted = lambda: 2 * H100_SMS  # as on an H100, for the blocks it picks
    failed = spilled = narrow = 0
    seen: set[str] = set()
    print("| kernel | blocks / constants | registers | spill bytes | global loads (bits x count) |")
    print("|---|---|---|---|---|")
    for label, module, call, name in cases():
        with recording(module) as recorders:
            call()
        recorder = recorders[name]
        for call_args, call_kwargs in recorder.calls:
            constants = {k: v for k, v in call_kwargs.items() if k.isupper()}
            key = f"{name} {sorted(constants.items())} {call_kwargs.get('num_warps')}"
            if key in seen:
                continue
            seen.add(key)
            shown = ", ".join(f"{k}={v}" for k, v in constants.items() if k.startswith("BLOCK") or k == "CHUNK")
            try:
                compiled = compile_call(recorder.kernel, call_args, dict(call_kwargs), args.arch)
                ptx = compiled.asm["ptx"]
                regs, spills = ptxas_usage(ptx, args.arch)
            except Exception as e:  # a kernel that does not compile is the finding
                failed += 1
                print(f"| {label} | {shown} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | |")
                continue
            spilled += spills > 0
            loads = load_widths(ptx)
            problems = []
            if name == "_gemv_kernel":
                # The weight stream (its loads are the evict-first ones) must move 16 bytes a load.
                weights = load_widths("\n".join(line for line in ptx.splitlines() if "evict_first" in line))
                if not weights or set(weights) != {"128"}:
                    problems.append(f"weight loads of {sorted(weights)} bits, not 128")
                if constants.get("PDL") and "griddepcontrol.wait" not in ptx:
                    problems.append("PDL without griddepcontrol.wait")
            if constants.get("TRIGGER") and "griddepcontrol.launch_dependents" not in ptx:
                problems.append("TRIGGER without griddepcontrol.launch_dependents")
            if constants.get("MERGE") or constants.get("ARGMAX") or name == "_argmax_kernel":
                # The last split (or GEMV program) merges what the others stored: their stores
                # must come before the count (a barrier, then an acquire-release atomic at GPU scope).
                if not re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.acq_rel\.gpu\.global\.add", ptx):
                    problems.append("a merge without an acquire-release atomic add at GPU scope")
                if "bar.sync" not in ptx and "barrier.sync" not in ptx:
                    problems.append("a merge without a barrier before the count")
            if "float16" in label and HALF_ARITHMETIC.search(ptx):
                problems.append(f"float16 arithmetic ({HALF_ARITHMETIC.search(ptx).group(0).strip()}): "
                                "torch's roundings lost")
            narrow += bool(problems)
            shown_loads = ", ".join(f"{bits}x{count}" for bits, count in sorted(loads.items(), key=lambda kv: -int(kv[0])))
            note = f" ({'; '.join(problems)})" if problems else ""
            print(f"| {label} | {shown} | {regs} | {spills} | {shown_loads}{note} |", flush=True)
    print(f"{len(seen)} compiles for sm_{args.arch}: {failed} failed, {spilled} spill, {narrow} with narrow weight loads, "
          "a missing grid-dependency instruction or float16 arithmetic")
    return 1 if failed or narrow or (args.no_spills and spilled) else 0

if __name__ == "__main__":
    sys.exit(main())
