"""A tiny random Qwen3-Next with a byte-level tokenizer and a ChatML template, for engine tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_reference import build_hf_model, save_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS)
IM_END = 258
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_map.values()) == set(alphabet)
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def _bytes_to_unicode() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_chat_model(path: Path, seed: int = 5, **overrides: Any) -> tuple[Path, Any]:
    """Checkpoint + tokenizer + template in `path`; returns (path, the transformers model)."""
    model = build_hf_model(seed=seed, vocab_size=VOCAB, **overrides)
    save_checkpoint(model, path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, 256]}))
    return path, model
