"""Text <-> token ids, from a Hugging Face `tokenizer.json`, and streaming decode.

Chat templates are not here yet.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

_REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model directory's end-of-sequence ids."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: Iterable[int] = ()) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json`; EOS ids are the union of those named in `generation_config.json`,
        `config.json` (`eos_token_id`, an int or a list, also in a vision-language config's
        `text_config`) and `tokenizer_config.json` (`eos_token`)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: a model directory holds config.json, tokenizer.json and its weights"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path}: not a valid tokenizer.json, truncated or corrupt ({e})") from None
        eos: set[int] = set()
        config = _read_json(model_dir / "config.json")
        text_config = config.get("text_config")
        for source in (_read_json(model_dir / "generation_config.json"), config, text_config):
            ids = source.get("eos_token_id") if isinstance(source, dict) else None
            eos.update([ids] if isinstance(ids, int) else ids or [])
        token = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):  # older files: {"content": "<|im_end|>", ...}
            token = token.get("content")
        if isinstance(token, str) and (token_id := backend.token_to_id(token)) is not None:
            eos.add(token_id)
        return cls(backend, eos)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata (see gguf_tokenizer.py)."""
        from hybridkv.engine.gguf_tokenizer import gguf_backend, gguf_eos_ids

        return cls(gguf_backend(metadata), gguf_eos_ids(metadata))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, special tokens included (a model's vocab may be padded larger)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added around it."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces whose concatenation is the decoded text.

    A piece never ends in half a UTF-8 character: while the text decoded so far ends in U+FFFD
    (a byte-level token that starts a multi-byte character), it is held back until the rest
    arrives; `flush()` releases whatever is left. Decoding is done over a short window of
    earlier tokens, so tokenizers that treat a leading space specially decode it as mid-text;
    `context` (e.g. the prompt's last ids) fills that window for the first piece.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(context[-6:])
        self._prefix = 0  # window start: decoded again each time, never emitted again
        self._read = len(self._ids)  # ids before this are emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Whatever is held back, as it decodes now (an incomplete character becomes U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}
