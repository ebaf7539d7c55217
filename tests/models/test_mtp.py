"""DeepSeek-V3's multi-token-prediction layer as a drafter (`speculative_method="mtp"`): the same
greedy tokens as decoding without it (HF's) under every scheduling, and each round's first guess
equal to an independent reference built from HF's decoder layer over HF's hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.models.arch import UnsupportedModelError
from tests.conftest import build_tiny_model
from tests.models.test_deepseek import MLA, SHORT
from tests.models.test_moe import hf_greedy

LAYERS = 3


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 whose checkpoint also holds a random MTP layer, `model.layers.3.*`
    (HF's classes do not model it: its own norms and projection, a sparse decoder layer
    perturbed from layer 1's weights, its own head)."""
    folder = build_tiny_model(tmp_path_factory.mktemp("mtp") / "v3", "deepseek_v3", seed=12, q_lora_rank=24,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                              num_hidden_layers=LAYERS, **MLA)
    return with_mtp_layer(folder)


def with_mtp_layer(folder: Path) -> Path:
    """`folder`'s checkpoint with a random MTP layer after its last."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(3)
    h, vocab = 64, 384
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", f"layers.{LAYERS}.")] = t + 0.02 * torch.randn(t.shape, generator=g)
    mtp = f"model.layers.{LAYERS}."
    tensors[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    tensors[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "shared_head.head.weight"] = 0.2 * torch.randn(vocab, h, generator=g)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return folder


def mtp_llm(folder: Path, **options) -> LLM:
    return LLM(str(folder), dtype="float64", speculative_method="mtp", **{"num_kv_blocks": 64, "block_size": 8,
                                                                         **options})


@pytest.mark.parametrize("options", [
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 3},
    {"num_speculative_tokens": 2, "max_num_batched_tokens": 16, "block_size": 4},
    {"num_speculative_tokens": 2, "num_kv_blocks": 12, "block_size": 4},
    {"num_speculative_tokens": 2, "num_kv_blocks": 12, "block_size": 4, "preemption_mode": "swap",
     "num_swap_blocks": 64},
], ids=["k1", "k3", "chunked", "preempt", "swap"])
def test_greedy_tokens_are_the_models_own(v3_with_mtp, options):
    """Verification keeps the output the model's whatever the layer guesses: HF's greedy tokens."""
    expected = hf_greedy(v3_with_mtp, SHORT, max_new_tokens=16)
    llm = mtp_llm(v3_with_mtp, **options)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if options.get("num_kv_blocks") == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    if "preemption_mode" not in options:  # every row the layer read was the target's (a swap loses some)
        assert llm.engine.drafter.store.num_missing == 0


def test_glm45_drafts_with_its_mtp_layer(tmp_path):
    """GLM-4.5's MTP layer (the same form over its grouped-query layer): the model's tokens."""
    from tests.models.test_deepseek import GLM

    folder = with_mtp_layer(build_tiny_model(tmp_path / "glm", "glm4_moe", seed=13, num_hidden_layers=LAYERS, **GLM))
    llm = mtp_llm(folder, num_speculative_tokens=2)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, SHORT, 12)
    assert llm.engine.drafter.store.num_missing == 0 and llm.engine.scheduler.num_draft_tokens > 0


def test_prefix_hits_keep_the_tokens(v3_with_mtp):
    """Prompts that share blocks: the target skips the cached positions, so the layer starts
    from the first hidden state it has and reads the shared blocks' rows as the earlier
    sequence's drafting wrote them; the tokens stay the model's."""
    shared = SHORT[0] + SHORT[1] + SHORT[2] + SHORT[4]
    prompts = [shared + p for p in SHORT]
    llm = mtp_llm(v3_with_mtp, num_speculative_tokens=2, block_size=4, max_num_seqs=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(v3_with_mtp, prompts, 10)
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.drafter.store.num_missing == 0


@pytest.fixture(scope="module")
def agreeing(v3_with_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint with the model's final norm and the layer's head norm zeroed: every
    logit 0, so the model always says token 0 and the layer always guesses it (every guess
    taken, which drives the rounds' bookkeeping of accepted positions)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("agreeing") / "v3"
    shutil.copytree(v3_with_mtp, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    key = f"model.layers.{LAYERS}.shared_head.norm.weight"
    tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16, "block_size": 4},
                                     {"num_kv_blocks": 12, "block_size": 4}], ids=["default", "chunked", "preempt"])
def test_guesses_taken_every_round(agreeing, options):
    """Every guess accepted, round after round: the positions guessed and kept are fed again from
    the target's hidden states (none missing), and the tokens are still the model's."""
    llm = mtp_llm(agreeing, num_speculative_tokens=3, **options)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(agreeing, SHORT, 13)
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    assert llm.engine.drafter.store.num_missing == 0


def reference_guesses(folder: Path, tokens: list[int]) -> list[int]:
    """Row p: the MTP layer over token p + 1 and HF's final hidden state at p, through HF's own
    DeepSeek-V3 decoder layer (its attention, experts, interleaved RoPE) with a causal mask;
    the argmax of the shared head: the guess for token p + 2."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    raw = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    prefix = f"model.layers.{LAYERS}."
    layer = DeepseekV3DecoderLayer(config, LAYERS).double().eval()
    state = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)
             and not k[len(prefix):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed"))}
    experts = range(config.n_routed_experts)  # the file keeps each expert apart; the module stacks them
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                state.pop(f"mlp.experts.{e}.up_proj.weight")))
                                                     for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    layer.load_state_dict(state)
    enorm, hnorm, norm = (DeepseekV3RMSNorm(64, config.rms_norm_eps).double() for _ in range(3))
    enorm.weight.data, hnorm.weight.data = raw[prefix + "enorm.weight"], raw[prefix + "hnorm.weight"]
    norm.weight.data = raw[prefix + "shared_head.norm.weight"]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]  # [T, h], after the final norm
        m = len(tokens) - 1
        embed = raw[prefix + "embed_tokens.weight"][ids[0, 1:]]
        x = torch.cat((enorm(embed), hnorm(hidden[:m])), dim=-1) @ raw[prefix + "eh_proj.weight"].T
        positions = torch.arange(m)[None]
        rope = DeepseekV3RotaryEmbedding(config)(x[None], positions)
        mask = torch.full((m, m), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        logits = norm(out[0]) @ raw[prefix + "shared_head.head.weight"].T
    return logits.argmax(dim=-1).tolist()


def record_first_guesses(drafter) -> dict[int, list[tuple[int, int]]]:
    """Each round's first guess of each sequence, as `(tokens known, guess)`, recorded from now on."""
    firsts: dict[int, list[tuple[int, int]]] = {}
    after = drafter._after

    def record(it, guesses):
        firsts.setdefault(it.seq_id, []).append((it.start_pos + 1, guesses[0]))
        return after(it, guesses)

    drafter._after = record
    return firsts


def test_each_rounds_first_guess_is_the_reference(v3_with_mtp):
    """The drafter's first guess every round of every sequence (its rows fed over several
    rounds, from the target's hidden states kept step by step) is the reference's at that
    position. (A random layer's guesses are rarely the random model's tokens: the rounds with
    guesses taken are `test_guesses_taken_every_round`'s.)"""
    from conveyor.runner.mtp import MTPDrafter

    llm = mtp_llm(v3_with_mtp, num_speculative_tokens=2)
    drafter = llm.engine.drafter
    assert isinstance(drafter, MTPDrafter)
    firsts = record_first_guesses(drafter)
    prompts = SHORT[:3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seqs = sorted(firsts)
    assert len(seqs) == len(prompts)
    for seq_id, prompt, out in zip(seqs, prompts, outs, strict=True):
        tokens = prompt + out.outputs[0].token_ids
        ref = reference_guesses(v3_with_mtp, tokens)
        for known, guess in firsts[seq_id]:
            assert guess == ref[known - 2], (seq_id, known)
    assert drafter.store.num_missing == 0


def test_what_mtp_needs_is_checked(v3_with_mtp, deepseek_models):
    with pytest.raises(UnsupportedModelError, match="multi-token-prediction layer"):
        mtp_llm(deepseek_models["deepseek_v3"])  # a checkpoint without one
    with pytest.raises(ConfigError, match=r"DeepSeek-V3 or GLM-4\.5"):
        mtp_llm(deepseek_models["deepseek_v2"])
    from conveyor.config import EngineConfig
    from conveyor.sim.engine import build_sim_engine
    from conveyor.sim.hardware import get_hardware
    from conveyor.sim.models import get_model

    with pytest.raises(ConfigError, match="not a DeepSeek-style mixture"):  # the simulator's check
        build_sim_engine(EngineConfig.from_kwargs(speculative_method="mtp"), get_hardware("h100-sxm"),
                         get_model("llama-3.1-8b"), acceptance_rate=0.8)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory):
    from tests.models.test_deepseek import deepseek_models as build

    return build.__wrapped__(tmp_path_factory)


def test_sampled_guesses_are_kept_by_speculative_sampling(agreeing):
    """Unseeded sampled requests draw the layer's guesses from its distribution: with every logit
    0 the model's and the layer's are one uniform distribution, so every drawn guess is kept
    (a greedy guess, token 0, would be kept 1 time in the vocabulary's size)."""
    llm = mtp_llm(agreeing, num_speculative_tokens=3)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20
