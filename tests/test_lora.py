"""LoRA adapters on a real model, against HF transformers with each adapter merged into the
weights (`W + scale * B @ A`, written here from PEFT's definition) on the tiny Llama in float64.

Requests of the base model and of three adapters run in one batch, the same prompts under
each (so the prefix cache would hand out another adapter's K/V if it could): every output must
be the merged model's greedy tokens, under every scheduling of tests/schedulings.py and with
one adapter a step. The adapters differ in what they adapt: q and v only (a fused projection
with a slice missing), all seven projections with rsLoRA's scale, and two MLP projections in
two of the three layers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor import LLM, InvalidRequestError, LoRARequest, SamplingParams
from tests.schedulings import SCHEDULINGS

EOS = 2
VOCAB = 384
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PREFIX = {name: "self_attn" for name in ATTN} | {name: "mlp" for name in ("gate_proj", "up_proj", "down_proj")}
SPECS = {  # name -> (rank, alpha, modules, layers, rslora)
    "attn-qv": (4, 8, ("q_proj", "v_proj"), (0, 1, 2), False),
    "everything": (8, 16, tuple(PREFIX), (0, 1, 2), True),
    "mlp-some": (2, 4, ("gate_proj", "down_proj"), (0, 2), False),
}


def write_adapter(folder: Path, model_dir: Path, rank: int, alpha: float, modules: tuple[str, ...],
                  layers: tuple[int, ...], rslora: bool, seed: int, std: float = 0.08, dora: bool = False) -> Path:
    """A random adapter in PEFT's layout for the HF model in `model_dir` (with `dora`, a DoRA
    one: each adapted row's magnitude 0.7-1.3 times its merged weight's norm)."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    base = merged_model(model_dir, None) if dora else None
    scale = alpha / rank**0.5 if rslora else alpha / rank
    for layer in layers:
        for name in modules:
            fan_in, fan_out = dims[name]
            key = f"base_model.model.model.layers.{layer}.{PREFIX[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std * 4
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
            if base is not None:
                w = base.get_submodule(key.removeprefix("base_model.model.")).weight.double()
                merged = w + scale * tensors[f"{key}.lora_B.weight"].double() @ tensors[f"{key}.lora_A.weight"].double()
                tensors[f"{key}.lora_magnitude_vector"] = (
                    torch.linalg.vector_norm(merged, dim=1) * (0.7 + 0.6 * torch.rand(fan_out, generator=g, dtype=torch.float64))
                ).float()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": list(modules), "use_rslora": rslora, "base_model_name_or_path": str(model_dir),
        "use_dora": dora,
    }))
    return folder


def merged_reference(model_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int,
                     dtype: torch.dtype = torch.float64, **load: Any) -> list[list[int]]:
    """HF's greedy tokens with the adapter merged into the weights (`load`: from_pretrained's
    options)."""
    model = merged_model(model_dir, adapter, dtype, **load)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def merged_model(model_dir: Path, adapter: Path | None, dtype: torch.dtype = torch.float64, **load: Any) -> Any:
    """The HF model with the adapter merged into its weights (a DoRA one's rows rescaled to their
    magnitudes: `m * (W + s B A) / |W + s B A|`, PEFT's merge)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **load).eval()
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        r, alpha = config["r"], config["lora_alpha"]
        scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith("lora_A.weight"):
                    b = tensors[key.replace("lora_A", "lora_B")]
                    module = model.get_submodule(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"))
                    merged = module.weight.double() + scale * (b.double() @ a.double())
                    magnitude = tensors.get(key.replace("lora_A.weight", "lora_magnitude_vector"))
                    if magnitude is not None:
                        merged = merged * (magnitude.double() / torch.linalg.vector_norm(merged, dim=1))[:, None]
                    module.weight.copy_(merged.to(dtype))
    return model


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    model_dir = tiny_models["llama"]
    return {
        name: LoRARequest(name, k + 1, str(write_adapter(root / name, model_dir, *spec, seed=k)))
        for k, (name, spec) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def cases(tiny_models, adapters):
    """(prompt, adapter or None, HF's merged greedy tokens): each prompt under each adapter."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(17, 24))] for _ in range(4)]
    out = []
    for lora in [None, *adapters.values()]:
        wants = merged_reference(tiny_models["llama"], None if lora is None else Path(lora.lora_path), prompts, 12)
        out += [(p, lora, w) for p, w in zip(prompts, wants, strict=True)]
    base = [w for _, lora, w in out if lora is None]
    for lora in adapters.values():
        assert [w for _, lo, w in out if lo is lora] != base, f"{lora.lora_name} changes nothing: nothing is tested"
    return out


@SCHEDULINGS
def test_greedy_tokens_equal_hf_with_each_adapter_merged(tiny_models, cases, options):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_loras=3,
              **{"num_kv_blocks": 128, **options})
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([p for p, _, _ in cases], params, use_tqdm=False, lora_request=[lo for _, lo, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def test_float32_on_cpu_with_the_native_kernels(tiny_models, adapters):
    """The CPU's float32 path: steps of the base model alone run the fused native decode,
    steps with an adapter the modules (native norms, RoPE, attention and skinny GEMVs) with
    the deltas added; both give HF's float32 greedy tokens, merged for the adapters."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    loras = [None, adapters["everything"], adapters["attn-qv"]]
    want = []
    for lora in loras:
        want += merged_reference(tiny_models["llama"], None if lora is None else Path(lora.lora_path), prompts, 16,
                                 torch.float32)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=128)
    from conveyor.kernels import decode_layers

    assert (llm.engine.runner.model.fused_decode is not None) == (decode_layers() is not None)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = llm.generate(prompts * 3, params, use_tqdm=False, lora_request=[lo for lo in loras for _ in prompts])
    assert [o.outputs[0].token_ids for o in outs] == want


def test_one_adapter_a_step_serves_them_all_in_turn(tiny_models, cases):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, num_kv_blocks=128)
    engine = llm.engine
    seen: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recorded(now: float):
        out = schedule(now)
        seen.append({it.lora_request.lora_name for it in out.scheduled if it.lora_request is not None})
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([p for p, _, _ in cases], params, use_tqdm=False, lora_request=[lo for _, lo, _ in cases])
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3
    assert engine.runner.lora.num_loads >= 3 and len(engine.runner.lora.loaded) == 1  # max_cpu_loras = max_loras


def test_a_name_given_a_new_id_is_another_adapter(tiny_models, cases, adapters):
    """What a server's unload and load under the same name does (`LoRARequest.key`): the new id
    loads the other folder and its own K/V, never the old adapter's weights or cached blocks,
    though its prompts' blocks under the old id are cached and the old id still runs."""
    old = adapters["attn-qv"]
    new = LoRARequest(old.lora_name, 99, adapters["mlp-some"].lora_path)
    want = {lo: [w for _, lora, w in cases if lora is lo] for lo in (old, adapters["mlp-some"])}
    prompts = [p for p, lora, _ in cases if lora is None]
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_loras=2, num_kv_blocks=128)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = llm.generate(prompts, params, use_tqdm=False, lora_request=old)
    assert [o.outputs[0].token_ids for o in first] == want[old]
    hits = llm.engine.scheduler.block_manager.num_hit_tokens
    both = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=[new] * 4 + [old] * 4)
    assert [o.outputs[0].token_ids for o in both] == want[adapters["mlp-some"]] + want[old]
    assert llm.engine.scheduler.block_manager.num_hit_tokens > hits  # the old id's blocks were hit, by it alone


def test_sampled_requests_of_an_adapter_are_reproducible_beside_others(tiny_models, adapters):
    """A seeded sampled request gives the same tokens alone and in a batch of other adapters."""
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_loras=3, num_kv_blocks=128)
    lora = adapters["everything"]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    alone = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    again = llm.generate([[9, 10], [5, 6, 7, 8]], params, use_tqdm=False, lora_request=[None, lora])
    assert again[1].outputs[0].token_ids == alone


def test_bad_adapters_are_refused_before_anything_runs(tiny_models, adapters, tmp_path):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_lora_rank=4, num_kv_blocks=64)
    ok = adapters["attn-qv"]
    cases = {
        "no adapter_config.json": LoRARequest("missing", 9, str(tmp_path / "nowhere")),
        "exceeds max_lora_rank=4": adapters["everything"],
    }
    wrong = write_adapter(tmp_path / "wrong", tiny_models["qwen3"], 2, 4, ("q_proj",), (0,), False, seed=1)
    cases["do not fit this model"] = LoRARequest("wrong", 10, str(wrong))
    dora = write_adapter(tmp_path / "dora", tiny_models["llama"], 2, 4, ("q_proj",), (0,), False, seed=1)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    cases["DoRA: layer 0 q_proj has no magnitude vector"] = LoRARequest("dora", 11, str(dora))
    head = write_adapter(tmp_path / "head", tiny_models["llama"], 2, 4, ("q_proj",), (0,), False, seed=1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(head / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(2, 64)
    save_file(tensors, str(head / "adapter_model.safetensors"))
    cases["adapts no projection of a decoder layer"] = LoRARequest("head", 12, str(head))
    cases["was loaded from"] = LoRARequest("attn-qv", ok.lora_int_id, str(wrong))  # its name and id, another path
    llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=ok)  # loads attn-qv
    for match, lora in cases.items():
        with pytest.raises(InvalidRequestError, match=match) as info:
            llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=[None, lora])
        assert info.value.param == "lora_request"
        assert not llm.engine.has_unfinished_requests()
    plain = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        plain.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=ok)


def test_a_pinned_adapter_stays_loaded_while_others_take_turns(tiny_models, cases, adapters):
    """vLLM's add_lora, pin_lora, list_loras and remove_lora: a pinned adapter is loaded once
    however many others take turns in the `max_cpu_loras` places beside it; the tokens stay HF's
    merged."""
    pinned, others = adapters["everything"], [adapters["attn-qv"], adapters["mlp-some"]]
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_loras=1, max_cpu_loras=1,
              num_kv_blocks=128)
    lora = llm.engine.runner.lora
    assert llm.add_lora(pinned) and llm.list_loras() == {pinned.lora_int_id} and lora.num_loads == 1
    assert llm.pin_lora(pinned.lora_int_id)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for _ in range(2):
        for used in [*others, pinned]:
            picked = [(p, w) for p, lo, w in cases if lo is used]
            outs = llm.generate([p for p, _ in picked], params, use_tqdm=False, lora_request=used)
            assert [o.outputs[0].token_ids for o in outs] == [w for _, w in picked], used.lora_name
            assert pinned.lora_int_id in llm.list_loras() and len(llm.list_loras()) == 2
    assert lora.num_loads == 1 + 2 * len(others)  # the others take turns in one place; the pinned never goes
    assert llm.list_loras() == {pinned.lora_int_id, others[1].lora_int_id}  # the last one run
    with pytest.raises(InvalidRequestError, match="max_cpu_loras=1 adapters are pinned already"):
        llm.pin_lora(others[1].lora_int_id)
    assert llm.add_lora(others[0]) and llm.list_loras() == {pinned.lora_int_id, others[0].lora_int_id}
    assert llm.remove_lora(pinned.lora_int_id) and not llm.remove_lora(pinned.lora_int_id)
    assert llm.list_loras() == {others[0].lora_int_id}
    assert llm.pin_lora(others[0].lora_int_id)  # a place for a pin again
    with pytest.raises(InvalidRequestError, match="was loaded from"):  # removed, its name and id stay its own
        llm.add_lora(LoRARequest(pinned.lora_name, pinned.lora_int_id, others[0].lora_path))
    with pytest.raises(InvalidRequestError, match="add_lora it first"):
        llm.pin_lora(pinned.lora_int_id)


def test_pins_and_a_step_of_several_adapters_load_nothing_twice(tiny_models, cases, adapters):
    """A pin takes no place of `max_cpu_loras`: beside a pinned adapter, a batch of two others
    (`max_loras=2`, `max_cpu_loras=2`) keeps both, each loaded once, not at each step."""
    names = ["attn-qv", "mlp-some"]
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_lora=True, max_loras=2, max_cpu_loras=2,
              num_kv_blocks=128)
    llm.add_lora(adapters["everything"])
    llm.pin_lora(adapters["everything"].lora_int_id)
    picked = [(p, lo, w) for p, lo, w in cases if lo is not None and lo.lora_name in names]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([p for p, _, _ in picked], params, use_tqdm=False, lora_request=[lo for _, lo, _ in picked])
    assert [o.outputs[0].token_ids for o in outs] == [w for *_, w in picked]
    assert llm.engine.runner.lora.num_loads == 3
    assert adapters["everything"].lora_int_id in llm.list_loras()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dora_adapters_give_hfs_tokens_with_the_merged_weights(tiny_models, tmp_path, family):
    """DoRA (PEFT's `use_dora`): each adapted row rescaled to its trained magnitude, on every
    projection (the qwen2 model's q/k/v biases kept out of the gain), beside a plain LoRA adapter
    and the base model in one batch; HF with the DoRA merge is the reference, in float64 and in
    float32 on the native CPU kernels."""
    model = tiny_models[family]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 20))] for _ in range(3)]
    dora = LoRARequest("dora", 1, str(write_adapter(tmp_path / "dora", model, *SPECS["everything"], seed=3, dora=True)))
    qv = LoRARequest("qv", 2, str(write_adapter(tmp_path / "qv", model, 4, 8, ("q_proj", "v_proj"), (0, 2), False,
                                                seed=4, dora=True)))
    plain = LoRARequest("plain", 3, str(write_adapter(tmp_path / "plain", model, *SPECS["attn-qv"], seed=5)))
    loras = [None, dora, qv, plain]
    for dtype in (torch.float64, torch.float32):
        want = []
        for lora in loras:
            want += merged_reference(model, None if lora is None else Path(lora.lora_path), prompts, 10, dtype)
        assert want[3:6] != want[:3] and want[6:9] != want[:3], "the DoRA adapters change nothing"
        llm = LLM(str(model), dtype=str(dtype).removeprefix("torch."), enable_lora=True, max_loras=3, num_kv_blocks=128)
        outs = llm.generate(prompts * 4, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False,
                            lora_request=[lo for lo in loras for _ in prompts])
        assert [o.outputs[0].token_ids for o in outs] == want, dtype


def test_dora_magnitudes_are_checked(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_models["llama"]
    llm = LLM(str(model), dtype="float64", enable_lora=True, num_kv_blocks=64)
    folder = write_adapter(tmp_path / "short", model, 2, 4, ("q_proj",), (0,), False, seed=1, dora=True)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_magnitude_vector"))
    save_file({**tensors, key: tensors[key][:5]}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match=r"magnitude vector \(5,\) does not fit"):
        llm.add_lora(LoRARequest("short", 1, str(folder)))
    plain = write_adapter(tmp_path / "plain", model, 2, 4, ("q_proj",), (0,), False, seed=1)
    tensors = load_file(str(plain / "adapter_model.safetensors"))
    save_file({**tensors, key: torch.ones(64)}, str(plain / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="use_dora is not set"):
        llm.add_lora(LoRARequest("plain", 2, str(plain)))
