"""A byte-level BPE tokenizer trained in memory to the tiny models' vocabulary (384 ids), so
structured outputs can be tested end to end on a random-weight model against HF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CORPUS = [
    'the cat sat on the mat and the dog ran to the park; yes no maybe 12 345 6789 0.5',
    '{"name": "bob", "age": 42, "tags": ["a", "b"], "ok": true, "none": null}',
    'cats dogs birds fish 2024-01-31 hello world! abc xyz',
] * 50


def with_tokenizer(model_dir: Path, out_dir: Path, vocab_size: int = 384) -> Path:
    """A copy of `model_dir` with a tokenizer: ids 0-2 are <unk>, <s> and </s> (the tiny
    models' bos 1 and eos 2), then the 256 bytes, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shutil.copytree(model_dir, out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    }))
    return out_dir
