"""EAGLE-1 and EAGLE-3 heads as drafters (`speculative_method="eagle"` / `"eagle3"`): the same
greedy tokens as HF's without them under every scheduling, and each round's first guess equal
to a reference assembled from HF's own Llama layer, attention and norms over HF's hidden
states (the last one for EAGLE-1; the streams entering three layers for EAGLE-3)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.models.arch import UnsupportedModelError
from tests.conftest import build_tiny_model
from tests.models.test_moe import hf_greedy
from tests.models.test_mtp import record_first_guesses

H, HEADS, KV_HEADS, FF, VOCAB, LAYERS = 64, 4, 2, 128, 384, 4
_rng = random.Random(5)
SHORT = [[_rng.randrange(3, VOCAB) for _ in range(_rng.randint(1, 14))] for _ in range(6)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("eagle") / "llama", "llama", seed=21, num_hidden_layers=LAYERS)


def write_head(folder: Path, method: str, seed: int, *, draft_vocab: int = VOCAB, own_embedding: bool = False,
               bin_file: bool = False, prefix: str = "", aux_ids: list[int] | None = None,
               silent: bool = False, no_map: bool = False) -> Path:
    """A random head in a published checkpoint's shape: SafeAILab's names (`midlayer.*` for
    EAGLE-3, a `d2t` map to a random subset of the vocabulary), under `prefix` (vLLM's
    "model."), in `pytorch_model.bin` or safetensors; `no_map`: the model's whole vocabulary
    and no `d2t` / `t2d` (told apart from EAGLE-1 by its layer's names). `silent`: every output 0, so every
    logit is equal and the guess is token 0 (what a model whose logits are all 0 says)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    eagle3 = method == "eagle3"
    layer = "midlayer." if eagle3 else "layers.0."
    width = 2 * H if eagle3 else H
    t = {
        layer + "self_attn.q_proj.weight": rand(HEADS * 16, width),
        layer + "self_attn.k_proj.weight": rand(KV_HEADS * 16, width),
        layer + "self_attn.v_proj.weight": rand(KV_HEADS * 16, width),
        layer + "self_attn.o_proj.weight": rand(H, HEADS * 16),
        layer + "post_attention_layernorm.weight": 1 + rand(H),
        layer + "mlp.gate_proj.weight": rand(FF, H),
        layer + "mlp.up_proj.weight": rand(FF, H),
        layer + "mlp.down_proj.weight": rand(H, FF),
    }
    if eagle3:
        t[layer + "input_layernorm.weight"] = 1 + rand(H)
        t[layer + "hidden_norm.weight"] = 1 + rand(H)
        t["fc.weight"] = rand(H, 3 * H, scale=0.1)
        t["norm.weight"] = torch.zeros(H) if silent else 1 + rand(H)
        t["lm_head.weight"] = rand(draft_vocab, H, scale=0.5)
        ids = sorted(random.Random(seed).sample(range(1, VOCAB), draft_vocab - 1))
        ids = [0, *ids]  # (draft token 0 is the model's token 0)
        t["d2t"] = torch.tensor(ids) - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True)
    else:
        t["fc.weight"] = torch.zeros(H, 2 * H) if silent else rand(H, 2 * H, scale=0.1)
        t["fc.bias"] = torch.zeros(H) if silent else rand(H)
        if silent:
            t[layer + "mlp.down_proj.weight"] = torch.zeros(H, FF)
    if no_map:
        del t["d2t"], t["t2d"]
    if own_embedding:
        t["embed_tokens.weight"] = rand(VOCAB, H, scale=0.5)
    t = {prefix + k if k not in ("d2t", "t2d", "lm_head.weight") else k: v for k, v in t.items()}
    folder.mkdir(parents=True)
    if bin_file:
        torch.save(t, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(t, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": FF,
           "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
           "rope_theta": 10000.0}
    if eagle3:
        cfg["draft_vocab_size"] = draft_vocab
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


HEADS_MADE = {
    "eagle1": dict(method="eagle", seed=1),
    "eagle1_bin_own_embedding": dict(method="eagle", seed=2, bin_file=True, own_embedding=True),
    "eagle3": dict(method="eagle3", seed=3, draft_vocab=96),
    "eagle3_vllm_names_aux": dict(method="eagle3", seed=4, draft_vocab=VOCAB, prefix="model.", aux_ids=[0, 1, 3],
                                  own_embedding=True, no_map=True),
}


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {name: write_head(root / name, **kw) for name, kw in HEADS_MADE.items()}  # type: ignore[arg-type]


def eagle_llm(target: Path, head: Path, **options) -> LLM:
    method = HEADS_MADE[head.name]["method"]
    return LLM(str(target), speculative_method=method, speculative_model=str(head),
               **{"dtype": "float64", "num_kv_blocks": 64, "block_size": 8, **options})


@pytest.mark.parametrize("name", list(HEADS_MADE))
@pytest.mark.parametrize("options", [
    {"num_speculative_tokens": 3},
    {"num_speculative_tokens": 2, "max_num_batched_tokens": 16, "block_size": 4},
    {"num_speculative_tokens": 2, "num_kv_blocks": 12, "block_size": 4},
], ids=["k3", "chunked", "preempt"])
def test_greedy_tokens_are_the_models_own(target, heads, name, options):
    """Verification keeps the output the model's whatever the head guesses: HF's greedy tokens."""
    llm = eagle_llm(target, heads[name], **options)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(target, SHORT, 16)
    assert llm.engine.scheduler.num_draft_tokens > 0
    if options.get("num_kv_blocks") == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.drafter.store.num_missing == 0


def reference_guesses(target: Path, head: Path, tokens: list[int]) -> list[int]:
    """Row p: the head over token p + 1 and HF's states at p, through HF's own Llama layer (or,
    for EAGLE-3, HF's attention with projections two states wide, its MLP and norms) with a
    causal mask; the guess for token p + 2 as a model token id."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    config = model.config
    config._attn_implementation = "eager"
    file = head / "model.safetensors"
    raw = load_file(str(file)) if file.is_file() else torch.load(head / "pytorch_model.bin", weights_only=True)
    raw = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in raw.items()}
    raw = {k: v if k == "d2t" else v.double() for k, v in raw.items()}
    cfg = json.loads((head / "config.json").read_text())
    eagle3 = "layers.0.hidden_norm.weight" in raw
    layer_state = {k.removeprefix("layers.0."): v for k, v in raw.items() if k.startswith("layers.0.")}
    embed = raw.get("embed_tokens.weight", model.model.embed_tokens.weight.detach())
    ids = torch.tensor([tokens])
    m = len(tokens) - 1
    positions = torch.arange(m)[None]
    mask = torch.full((m, m), float("-inf"), dtype=torch.float64).triu(1)[None, None]

    def norm(key: str) -> LlamaRMSNorm:
        n = LlamaRMSNorm(H, config.rms_norm_eps).double()
        n.weight.data = raw[key] if key in raw else layer_state[key]
        return n

    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # [0]: the embeddings; [-1]: after the norm
        e = embed[ids[0, 1:]]
        if not eagle3:
            x = torch.cat((e, states[-1][0, :m]), dim=-1) @ raw["fc.weight"].T + raw["fc.bias"]
            layer = LlamaDecoderLayer(config, 0).double().eval()
            layer_state["input_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
            layer.load_state_dict(layer_state)
            layer.input_layernorm = torch.nn.Identity()
            rope = LlamaRotaryEmbedding(config)(x[None], positions)
            out = layer(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)
            out = out[0] if isinstance(out, tuple) else out
            return (out[0] @ model.lm_head.weight.T).argmax(dim=-1).tolist()
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, LAYERS // 2, LAYERS - 3]
        g = torch.cat([states[i][0, :m] for i in aux], dim=-1) @ raw["fc.weight"].T
        attn = LlamaAttention(config, 0).double().eval()
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = layer_state[f"self_attn.{proj}.weight"]
            setattr(attn, proj, torch.nn.Linear(2 * H, w.shape[0], bias=False).double())
            getattr(attn, proj).weight.data = w
        attn.o_proj.weight.data = layer_state["self_attn.o_proj.weight"]
        x = torch.cat((norm("input_layernorm.weight")(e), norm("hidden_norm.weight")(g)), dim=-1)
        rope = LlamaRotaryEmbedding(config)(x[None], positions)
        a = attn(x[None], position_embeddings=rope, attention_mask=mask)[0][0]
        r = g + a
        mlp = LlamaMLP(config).double()
        mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in layer_state.items() if k.startswith("mlp.")})
        out = r + mlp(norm("post_attention_layernorm.weight")(r))
        best = (norm("norm.weight")(out) @ raw["lm_head.weight"].T).argmax(dim=-1)
        return (best + raw["d2t"][best] if "d2t" in raw else best).tolist()


@pytest.mark.parametrize(("name", "dtype"), [*((n, "float64") for n in HEADS_MADE), ("eagle1", "float32"),
                                             ("eagle3", "float32")])
def test_each_rounds_first_guess_is_the_reference(target, heads, name, dtype):
    """The drafter's first guess every round of every sequence (its rows fed over several
    rounds from the states kept step by step) is the reference's at that position; in float32
    too, where the head runs the native CPU kernels the model's layers run."""
    from conveyor.models.llama import SkinnyLinear
    from conveyor.runner.mtp import MTPDrafter

    llm = eagle_llm(target, heads[name], num_speculative_tokens=2, dtype=dtype)
    if dtype == "float32" and skinny_available():
        assert isinstance(llm.engine.drafter.mtp.layer.layers[0].mlp.down_proj, SkinnyLinear)
    drafter = llm.engine.drafter
    assert isinstance(drafter, MTPDrafter)
    firsts = record_first_guesses(drafter)
    prompts = [p for p in SHORT if len(p) > 1][:3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seqs = sorted(firsts)
    assert len(seqs) == len(prompts)
    for seq_id, prompt, out in zip(seqs, prompts, outs, strict=True):
        tokens = prompt + out.outputs[0].token_ids
        ref = reference_guesses(target, heads[name], tokens)
        for known, guess in firsts[seq_id]:
            assert guess == ref[known - 2], (seq_id, known)
    assert drafter.store.num_missing == 0


def skinny_available() -> bool:
    from conveyor.kernels import skinny_linear

    return skinny_linear() is not None


@pytest.fixture(scope="module")
def silent_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with its final norm zeroed: every logit 0, so it always says token 0."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("silent") / "llama"
    shutil.copytree(target, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16, "block_size": 4},
                                     {"num_kv_blocks": 12, "block_size": 4}], ids=["default", "chunked", "preempt"])
def test_guesses_taken_every_round(silent_target, tmp_path, method, options):
    """A head that always guesses what the model always says: every guess accepted, round after
    round, the kept positions fed again from the model's states, the tokens still the model's."""
    head = write_head(tmp_path / method, method, seed=7, draft_vocab=64, silent=True)
    llm = LLM(str(silent_target), dtype="float64", speculative_method=method, speculative_model=str(head),
              num_speculative_tokens=3, **{"num_kv_blocks": 64, "block_size": 8, **options})
    outs = llm.generate(SHORT, SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(silent_target, SHORT, 13)
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    assert llm.engine.drafter.store.num_missing == 0


def test_sampled_requests_keep_their_seeded_tokens(target, heads):
    """A seeded sampled request draws the same tokens with the head as without it."""
    params = SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
    llm = eagle_llm(target, heads["eagle3"], num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want


def test_what_a_head_needs_is_checked(target, heads, tmp_path):
    with pytest.raises(UnsupportedModelError, match="use speculative_method='eagle3'"):
        LLM(str(target), speculative_method="eagle", speculative_model=str(heads["eagle3"]))
    with pytest.raises(UnsupportedModelError, match="use speculative_method='eagle'"):
        LLM(str(target), speculative_method="eagle3", speculative_model=str(heads["eagle1"]))
    with pytest.raises(ConfigError, match="needs a speculative_model"):
        LLM(str(target), speculative_method="eagle3")
    wide = build_tiny_model(tmp_path / "wide", "llama", seed=3, hidden_size=96, num_hidden_layers=LAYERS)
    with pytest.raises(UnsupportedModelError, match="64 wide over a model 96 wide"):
        LLM(str(wide), speculative_method="eagle", speculative_model=str(heads["eagle1"]))
    bad = write_head(tmp_path / "bad_aux", "eagle3", seed=8, aux_ids=[0, 1, LAYERS])
    with pytest.raises(UnsupportedModelError, match="reads three of the model's 4 layers"):
        LLM(str(target), speculative_method="eagle3", speculative_model=str(bad))
    cfg = json.loads((heads["eagle1"] / "config.json").read_text())
    two = tmp_path / "two_layers"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    (two / "model.safetensors").write_bytes((heads["eagle1"] / "model.safetensors").read_bytes())
    with pytest.raises(UnsupportedModelError, match="of 2 layers; one is built"):
        LLM(str(target), speculative_method="eagle", speculative_model=str(two))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampled_guesses_are_kept_by_speculative_sampling(silent_target, tmp_path, method):
    """Unseeded sampled requests draw the head's guesses from its distribution and keep them by
    speculative sampling. With every logit 0 the model's distribution is uniform over its 384
    tokens; EAGLE's head (the model's own LM head) is too, so every guess is kept (greedy ones
    would be kept 1 time in 384); EAGLE-3's head is uniform over its 64 tokens, so a guess is
    kept with probability 64 / 384 (the distributions' overlap), and the chains stay whole."""
    head = write_head(tmp_path / method, method, seed=7, draft_vocab=64, silent=True)
    llm = LLM(str(silent_target), dtype="float64", speculative_method=method, speculative_model=str(head),
              num_speculative_tokens=3, num_kv_blocks=128, block_size=8)
    params = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)
    outs = llm.generate(SHORT * 4, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    scheduler = llm.engine.scheduler
    rate = scheduler.num_accepted_tokens / scheduler.num_draft_tokens
    if method == "eagle":
        assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    else:  # (a round of 3 keeps 1/6 + 1/6^2 + 1/6^3 = 0.199 guesses on average: 0.066 of those verified)
        assert 0.04 < rate < 0.10, rate
    assert llm.engine.drafter.store.num_missing == 0
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 200  # (drawn, not the argmax's token 0)
