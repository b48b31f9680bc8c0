"""A tiny random Qwen3-Next with a byte-level tokenizer and a ChatML template, for engine tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from byte_level import ENDOFTEXT_ID, IM_END_ID, NUM_BYTES, SPECIAL_TOKENS, byte_tokenizer
from hf_reference import make_hf_model, save_checkpoint

VOCAB = NUM_BYTES + len(SPECIAL_TOKENS)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_chat_model(path: Path, seed: int = 5, **overrides: Any) -> tuple[Path, Any]:
    """Checkpoint + tokenizer + template in `path`; returns (path, the transformers model)."""
    model = make_hf_model(seed=seed, vocab_size=VOCAB, **overrides)
    save_checkpoint(model, path)
    byte_tokenizer().backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}))
    return path, model
