"""Quantized checkpoints, dequantized at load, against HF transformers loading the same folder:
HF's and vLLM's `fp8` method (e4m3 weights with `weight_scale_inv` block scales, as
Qwen3-*-FP8 and DeepSeek-V3 ship; HF dequantizes them on a machine without a GPU, exactly as
w * scale), and llm-compressor's compressed-tensors FP8 and packed integers (RedHatAI's *-FP8
and *-quantized.w4a16 models; HF's reference through the compressed-tensors package,
`dequantize=True`).

The checkpoints are written here from the tiny random models: every projection quantized to
e4m3 in blocks (a tensor-wide scale in one variant), the scales in a shard after the weights'
in another, the norms and embeddings left in float. A scale applied wrong, to the wrong block
or not at all changes the tokens and logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.models.loader import ModelLoadError
from tests.models.test_hf_parity import PROMPTS


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` over its `block` x `block` scales (the last blocks cut), each block's absolute maximum
    mapped to e4m3's 448: the values to round to FP8, and the scales."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    return (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols], scale


def write_fp8(src: Path, dst: Path, block: int | None = 32, split_scales: bool = False) -> Path:
    """`src` (a float checkpoint) as an FP8 one: each `*_proj.weight` in e4m3 with float32
    `weight_scale_inv` scales, a block's absolute maximum mapped to e4m3's 448 (`block`
    rows x columns; None: one scale for the tensor)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    weights, scales = {}, {}
    for name, w in tensors.items():
        if not name.endswith("_proj.weight"):
            weights[name] = w
            continue
        w = w.float()
        if block is None:
            scale = (w.abs().amax() / 448.0).clamp(min=1e-12)
            q = (w / scale).to(torch.float8_e4m3fn)
        else:
            q, scale = fp8_blocks(w, block)
            q = q.to(torch.float8_e4m3fn)
        weights[name] = q.contiguous()
        scales[name[: -len(".weight")] + ".weight_scale_inv"] = scale.float().reshape(scale.shape)
    dst.mkdir(parents=True, exist_ok=True)
    if split_scales:  # the scales in a shard of their own, read after every weight
        files = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
        for file, part in files.items():
            save_file(part, str(dst / file), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file({**weights, **scales}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": None if block is None else [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_greedy_fp8(path: Path, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, lps = list(p), []
            for _ in range(n):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
                t = int(logp.argmax())
                ids.append(t)
                lps.append(float(logp[t]))
            out.append((ids[len(p):], lps))
    return out


def conveyor_greedy(path: Path, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs]


@pytest.mark.parametrize("family,block,split", [("llama", 32, False), ("qwen3", 32, True), ("llama", None, False)],
                         ids=["llama-blocks", "qwen3-blocks-split-shards", "llama-tensor-scale"])
def test_fp8_checkpoints_load_as_hf_dequantizes_them(tiny_models, tmp_path, family, block, split):
    path = write_fp8(tiny_models[family], tmp_path / "fp8", block, split)
    want = hf_greedy_fp8(path, PROMPTS, 12)
    got = conveyor_greedy(path, PROMPTS, 12)
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt
        assert gl == pytest.approx(wl, abs=2e-4)
    plain = conveyor_greedy(tiny_models[family], PROMPTS[:2], 12)  # the float model: near, not equal
    assert any(a != pytest.approx(b, abs=1e-5) for (_, x), (_, y) in zip(got, plain, strict=False)
               for a, b in zip(x, y, strict=True))


def test_bad_fp8_checkpoints_say_why(tiny_models, tmp_path):
    path = write_fp8(tiny_models["llama"], tmp_path / "fp8", 32, split_scales=True)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="weights without scales"):
        LLM(str(path), num_kv_blocks=8)
    path = write_fp8(tiny_models["llama"], tmp_path / "wrong-block", 32)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 16]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="blocks of 16x16 cover a weight"):
        LLM(str(path), num_kv_blocks=8)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quant_method='awq' is not read here"):
        LLM(str(path), num_kv_blocks=8)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="format 'nvfp4-pack-quantized' is not read here"):
        LLM(str(path), num_kv_blocks=8)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 2, "type": "int", "strategy": "group"}}}}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="packs 2-bit int weights by 'group'"):
        LLM(str(path), num_kv_blocks=8)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group"}}}}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="holds 4-bit float weights"):
        LLM(str(path), num_kv_blocks=8)


def assert_as_hf_dequantizes(path: Path) -> None:
    """conveyor's greedy tokens and logprobs on `path` are HF's, HF dequantizing the folder with
    the compressed-tensors package (`CompressedTensorsConfig(dequantize=True)`), token by token."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    got = conveyor_greedy(path, PROMPTS, 12)
    with torch.no_grad():
        for (tokens, lps), p in zip(got, PROMPTS, strict=True):
            ids = list(p)
            for t, lp in zip(tokens, lps, strict=True):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
                assert t == int(logp.argmax()) and lp == pytest.approx(float(logp[t]), abs=2e-4)
                ids.append(t)


def write_compressed_tensors(src: Path, dst: Path, strategy: str) -> Path:
    """`src` as llm-compressor writes an FP8 model (`float-quantized`): each `*_proj.weight` in
    e4m3 with a `weight_scale` a tensor, a row (`channel`) or a 32x32 `block`; the LM head left."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    out = {}
    for name, w in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = w
            continue
        w = w.float()
        if strategy == "tensor":
            scale = (w.abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
            q = w / scale
        elif strategy == "channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            q = w / scale
        else:
            q, scale = fp8_blocks(w, 32)
        out[name] = q.to(torch.float8_e4m3fn).contiguous()
        out[name[: -len(".weight")] + ".weight_scale"] = scale.float().contiguous()
        out[name[: -len(".weight")] + ".input_scale"] = torch.ones(1)  # a static scheme's: dropped
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    weights: dict[str, object] = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                                  "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [32, 32]
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}},
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_loads_as_hf_dequantizes_it(tiny_models, tmp_path, strategy):
    """RedHatAI's FP8 layout (llm-compressor's `float-quantized`): HF's reference dequantizes it
    with the compressed-tensors package (`CompressedTensorsConfig(dequantize=True)`)."""
    pytest.importorskip("compressed_tensors")
    path = write_compressed_tensors(tiny_models["llama"], tmp_path / strategy, strategy)
    assert_as_hf_dequantizes(path)


def write_packed(src: Path, dst: Path, bits: int, strategy: str, symmetric: bool = True,
                 actorder: bool = False) -> Path:
    """`src` as llm-compressor packs integer weights (`pack-quantized`, the w4a16 / w8a16
    models): each `*_proj.weight` rounded to `bits`-bit integers a group of 32 columns (a row
    with "channel"), with zero points if asymmetric, and with act-order a random column order
    of the groups (`weight_g_idx`); packed by compressed-tensors' own `pack_to_int32`."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    gen = torch.Generator().manual_seed(bits)
    out, exact = {}, {}
    for name, w in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = w
            continue
        w = w.float()
        rows, cols = w.shape
        size = cols if strategy == "channel" else 32
        order = torch.randperm(cols, generator=gen) if actorder else torch.arange(cols)
        group_of = torch.empty(cols, dtype=torch.long)
        group_of[order] = torch.arange(cols) // size
        groups = -(-cols // size)
        scale, zero = torch.empty(rows, groups), torch.zeros(rows, groups)
        for g in range(groups):
            part = w[:, group_of == g]
            if symmetric:
                scale[:, g] = (part.abs().amax(dim=1) / hi).clamp(min=1e-8)
            else:
                low, high = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
                scale[:, g] = ((high - low) / (hi - lo)).clamp(min=1e-8)
                zero[:, g] = (lo - low / scale[:, g]).round().clamp(lo, hi)
        q = (w / scale[:, group_of] + zero[:, group_of]).round().clamp(lo, hi).to(torch.int8)
        base = name[: -len(".weight")]
        exact[name] = (q.float() - zero[:, group_of]) * scale[:, group_of]  # what the packed values mean
        out[base + ".weight_packed"] = pack_to_int32(q, bits)
        out[base + ".weight_scale"] = scale.contiguous()
        out[base + ".weight_shape"] = torch.tensor([rows, cols])
        if not symmetric:
            out[base + ".weight_zero_point"] = pack_to_int32(zero.to(torch.int8), bits, packed_dim=0)
        if actorder:
            out[base + ".weight_g_idx"] = group_of.to(torch.int32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric, "dynamic": False,
            "group_size": None if strategy == "channel" else 32, "actorder": "group" if actorder else None}}},
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    # the same model with the weights the packed values mean, in float: a reference of its own
    floats = dst.parent / f"{dst.name}-float"
    floats.mkdir(exist_ok=True)
    save_file({**{n: t for n, t in tensors.items() if n not in exact}, **exact}, str(floats / "model.safetensors"),
              metadata={"format": "pt"})
    (floats / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("bits,strategy,symmetric", [(4, "group", True), (4, "group", False), (8, "channel", True)],
                         ids=["w4-groups", "w4-zero-points", "w8-channels"])
def test_packed_integer_checkpoints_load_as_hf_dequantizes_them(tiny_models, tmp_path, bits, strategy, symmetric):
    """llm-compressor's `pack-quantized` (RedHatAI's w4a16 / w8a16): HF's reference dequantizes
    it with the compressed-tensors package."""
    pytest.importorskip("compressed_tensors")
    path = write_packed(tiny_models["llama"], tmp_path / "packed", bits, strategy, symmetric)
    assert_as_hf_dequantizes(path)



def test_act_order_groups_are_read_by_index(tiny_models, tmp_path):
    """GPTQ's act-order (`actorder: group`, older llm-compressor checkpoints: each column's group
    in `weight_g_idx`, here a random order): the model equals the float one holding the weights
    the packed values mean (compressed-tensors 0.20, HF's reference, no longer reads this form)."""
    pytest.importorskip("compressed_tensors")
    path = write_packed(tiny_models["llama"], tmp_path / "act-order", 4, "group", symmetric=False, actorder=True)
    got = conveyor_greedy(path, PROMPTS, 12)
    want = conveyor_greedy(tmp_path / "act-order-float", PROMPTS, 12)
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt and gl == pytest.approx(wl, abs=1e-6)
