"""Medusa heads as drafters (`speculative_method="medusa"`): HF's greedy tokens whatever they
guess, under chunked prompts, preemption by recompute and by swap; every round's guesses equal
to the heads' formula over HF's own last hidden state at the position before the step's input;
heads that always agree with their model have every guess taken; both checkpoint shapes
(FasterDecoding's and vLLM's, with a truncated vocabulary and one shared LM head) load, and a
head that cannot serve the model is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.models.arch import UnsupportedModelError
from conveyor.runner.medusa import MedusaDrafter
from tests.models import test_eagle
from tests.models.test_eagle import SHORT, VOCAB, H
from tests.models.test_moe import hf_greedy

target = test_eagle.target  # the same tiny Llama, and the one that always says token 0
silent_target = test_eagle.silent_target


def write_heads(folder: Path, seed: int, *, num_heads: int = 4, blocks: int = 1, style: str = "faster",
                bias: bool = True, shared: bool = False, draft_vocab: int = VOCAB, pt: bool = False,
                silent: bool = False) -> Path:
    """Random heads in a published checkpoint's shape: FasterDecoding's (`j.b.linear.*`, the LM
    head at `j.L.weight`, `medusa_lm_head.safetensors` or `.pt`) or vLLM's (`blocks.j.layers.b.*`,
    `lm_heads.j.weight`, a `token_map` where the vocabulary is truncated, one LM head with
    `original_lm_head`). `silent`: LM heads of zeros, so every guess is token 0."""
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for j in range(num_heads):
        for b in range(blocks):
            w, c = 0.3 * torch.randn(H, H, generator=g), 0.3 * torch.randn(H, generator=g)
            name = f"{j}.{b}.linear" if style == "faster" else f"medusa_heads.blocks.{j}.layers.{b}"
            t[f"{name}.weight"] = w
            if bias:
                t[f"{name}.bias"] = c
        if shared and j > 0:
            continue
        head = torch.zeros(draft_vocab, H) if silent else 0.5 * torch.randn(draft_vocab, H, generator=g)
        t[f"{j}.{blocks}.weight" if style == "faster" else f"medusa_heads.lm_heads.{j}.weight"] = head
    if draft_vocab != VOCAB:
        t["token_map"] = torch.randperm(VOCAB, generator=g)[:draft_vocab]
    folder.mkdir(parents=True)
    if pt:
        torch.save(t, folder / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file(t, str(folder / "medusa_lm_head.safetensors"))
    cfg: dict = ({"medusa_num_heads": num_heads, "medusa_num_layers": blocks, "base_model_name_or_path": "x"}
                 if style == "faster" else
                 {"model_type": "medusa", "num_heads": num_heads, "num_hidden_layers": blocks, "hidden_size": H,
                  "vocab_size": VOCAB, "truncated_vocab_size": draft_vocab, "original_lm_head": shared,
                  "medusa_fc_bias": bias})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


MADE = {
    "faster": dict(seed=1),
    "faster_pt_two_blocks": dict(seed=2, blocks=2, pt=True),
    "vllm_truncated_shared": dict(seed=3, style="vllm", bias=False, shared=True, draft_vocab=96),
}


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("medusa")
    return {name: write_heads(root / name, **kw) for name, kw in MADE.items()}  # type: ignore[arg-type]


def medusa_llm(model: Path, head: Path, **options) -> LLM:
    return LLM(str(model), speculative_method="medusa", speculative_model=str(head),
               **{"dtype": "float64", "num_kv_blocks": 64, "block_size": 8, "num_speculative_tokens": 3, **options})


def record_rounds(drafter: MedusaDrafter) -> list[tuple[list[int], list[int]]]:
    """Every round's `(tokens up to the step's input, guesses)`, recorded from now on."""
    rounds: list[tuple[list[int], list[int]]] = []
    fill = drafter.fill

    def recorded(out):
        fill(out)
        rounds.extend((list(it.all_token_ids[: it.start_pos]), list(it.token_ids[1:]))
                      for it in out.scheduled if it.num_draft)

    drafter.fill = recorded  # type: ignore[method-assign]
    return rounds


def reference_guesses(model_dir: Path, head: Path, tokens: list[int], count: int) -> list[int]:
    """The heads' formula over HF's last hidden state (after the final norm) at the last of
    `tokens`."""
    return [c[0] for c in reference_candidates(model_dir, head, tokens, [1] * count)]


def reference_candidates(model_dir: Path, head: Path, tokens: list[int], widths: list[int]) -> list[list[int]]:
    """Head j's `widths[j]` likeliest tokens by the formula, best first (`reference_guesses`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    files = list(head.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        raw = load_file(str(files[0]))
    else:
        raw = torch.load(head / "medusa_lm_head.pt", weights_only=True)
    raw = {k.removeprefix("medusa_heads."): v.double() if v.is_floating_point() else v for k, v in raw.items()}
    cfg = json.loads((head / "config.json").read_text())
    blocks = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    with torch.no_grad():
        h = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1]
    out = []
    for j, width in enumerate(widths):
        x = h
        for b in range(blocks):
            name = f"{j}.{b}.linear" if f"{j}.{b}.linear.weight" in raw else f"blocks.{j}.layers.{b}"
            x = x + F.silu(x @ raw[f"{name}.weight"].T + raw.get(f"{name}.bias", torch.zeros(H, dtype=x.dtype)))
        w = raw.get(f"{j}.{blocks}.weight", raw.get(f"lm_heads.{j}.weight", raw.get("lm_heads.0.weight")))
        logits = w @ x
        top = [int(logits.argmax())] if width == 1 else logits.topk(width).indices.tolist()
        out.append([int(raw["token_map"][t]) if "token_map" in raw else t for t in top])
    return out


@pytest.mark.parametrize("name", list(MADE))
@pytest.mark.parametrize("options", [
    {},
    {"num_speculative_tokens": 2, "max_num_batched_tokens": 16, "block_size": 4},
    {"num_kv_blocks": 12, "block_size": 4},
    {"num_kv_blocks": 12, "block_size": 4, "preemption_mode": "swap", "num_swap_blocks": 64},
], ids=["k3", "chunked", "preempt", "swap"])
def test_greedy_tokens_are_the_models_own_and_guesses_the_heads_formula(target, heads, name, options):
    """Verification keeps HF's greedy tokens whatever the heads guess; each round's guesses are
    the formula's over HF's hidden state at the position before the step's input."""
    llm = medusa_llm(target, heads[name], **options)
    drafter = llm.engine.drafter
    assert isinstance(drafter, MedusaDrafter)
    rounds = record_rounds(drafter)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(target, SHORT, 16)
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    if options.get("num_kv_blocks") == 12:
        assert sched.num_preemptions > 0
    assert drafter.store.num_missing == 0
    # A sample of rounds against the formula (each reference is a forward pass of HF's).
    sample = rounds[:: max(1, len(rounds) // 6)]
    assert len(sample) >= 3
    for tokens, guesses in sample:
        assert guesses == reference_guesses(target, heads[name], tokens, len(guesses))


def test_heads_that_agree_have_every_guess_taken(silent_target, tmp_path):
    """A model that always says token 0 and heads that always guess it: every guess accepted."""
    head = write_heads(tmp_path / "silent", seed=7, silent=True)
    llm = medusa_llm(silent_target, head, num_speculative_tokens=4)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(silent_target, SHORT, 13)
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens == sched.num_draft_tokens > 0


def test_sampled_requests_keep_their_seeded_tokens(target, heads):
    params = SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    plain = LLM(str(target), dtype="float64", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
    llm = medusa_llm(target, heads["faster"])
    assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want


def test_what_the_heads_need_is_checked(target, heads, tmp_path):
    with pytest.raises(ConfigError, match="4 heads, one a guess"):
        medusa_llm(target, heads["faster"], num_speculative_tokens=5)
    with pytest.raises(ConfigError, match="needs a speculative_model"):
        LLM(str(target), speculative_method="medusa")
    wide = tmp_path / "wide"
    write_heads(wide, seed=1)
    from safetensors.torch import load_file, save_file

    t = load_file(str(wide / "medusa_lm_head.safetensors"))
    t["0.1.weight"] = torch.zeros(VOCAB, H + 8)
    save_file(t, str(wide / "medusa_lm_head.safetensors"))
    with pytest.raises(UnsupportedModelError, match="wide"):
        medusa_llm(target, wide)
    small = write_heads(tmp_path / "small", seed=1, style="vllm", draft_vocab=96)
    t = load_file(str(small / "medusa_lm_head.safetensors"))
    del t["token_map"]
    save_file(t, str(small / "medusa_lm_head.safetensors"))
    with pytest.raises(UnsupportedModelError, match="no token_map"):
        medusa_llm(target, small)
    stray = write_heads(tmp_path / "stray", seed=1)
    t = load_file(str(stray / "medusa_lm_head.safetensors"))
    t["model.norm.weight"] = torch.ones(H)
    save_file(t, str(stray / "medusa_lm_head.safetensors"))
    with pytest.raises(UnsupportedModelError, match="no Medusa head's tensor"):
        medusa_llm(target, stray)


def test_float32_on_the_native_kernels_gives_decodings_tokens(target, heads):
    """On a CPU in float32 the heads run the skinny kernel and the verification the native
    decode call (chained rows): at batch 1 the tokens of decoding one a step."""
    from conveyor.kernels import skinny_linear

    if skinny_linear() is None:
        pytest.skip("native CPU kernels unavailable")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=1)
    want = [o.outputs[0].token_ids for o in plain.generate(SHORT, params, use_tqdm=False)]
    llm = medusa_llm(target, heads["faster_pt_two_blocks"], dtype="float32", max_num_seqs=1)
    drafter = llm.engine.drafter
    assert type(drafter.heads.blocks[0][0]).__name__ == "SkinnyLinear"
    assert [o.outputs[0].token_ids for o in llm.generate(SHORT, params, use_tqdm=False)] == want
    assert llm.engine.scheduler.num_draft_tokens > 0

