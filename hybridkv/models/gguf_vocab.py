"""A Hugging Face tokenizer's files as GGUF `tokenizer.*` metadata, as llama.cpp's converter
writes them (`TextModel.get_vocab_base` and gguf-py's `SpecialVocab`), for byte-level BPE
tokenizers (Qwen's); `engine.gguf_tokenizer` reads them back.

    tokenizer.ggml.model        "gpt2"
    tokenizer.ggml.pre          "qwen2" for Qwen3-Next, "qwen35" for Qwen3.5 (the names the
                                converter finds for those models' pre-tokenizers)
    tokenizer.ggml.tokens       by id up to the config's vocab_size; ids the tokenizer lacks are
                                "[PAD<id>]" of type unused
    tokenizer.ggml.token_type   1 normal; added tokens 3 control when special or looking special
                                ("<|...|>"), else 4 user-defined
    tokenizer.ggml.merges       "left right" (a space inside a part as U+0120, as gguf-py does)
    *_token_id                  tokenizer_config.json's `bos_token`, ... matched to added tokens,
                                then config.json's `*_token_id` for kinds still unset
    add_bos_token, add_eos_token  false under a ByteLevel post-processor, else tokenizer_config's
    tokenizer.chat_template     tokenizer_config.json's, else chat_template.jinja / .json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.errors import NotSupported
from hybridkv.models.gguf_container import INT32, STRING, Value, array, boolean, string, u32

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
PRE_TOKENIZER = {"qwen3_next": "qwen2", "qwen3_5": "qwen35"}
# gguf-py's SpecialVocab kinds, in its order, and the key each is written under
_SPECIAL_KINDS = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding"}
_SPECIAL_KINDS |= {"cls": "cls", "mask": "mask"}


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def _looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _merges(raw: list[Any]) -> list[str]:
    if not raw or isinstance(raw[0], str):
        return list(raw)
    return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair) for pair in raw]


def _vocabulary(tokenizer: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    added = {int(t["id"]): t for t in tokenizer.get("added_tokens", [])}
    by_id = {int(i): text for text, i in tokenizer["model"]["vocab"].items()}
    by_id |= {i: t["content"] for i, t in added.items()}
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has id {max(by_id)}, past the config's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added and (added[i].get("special") or _looks_special(text)):
            tokens.append(text)
            types.append(CONTROL)
        elif i in added:
            tokens.append(text.replace("\u2581", " "))
            types.append(USER_DEFINED)
        else:
            tokens.append(text)
            types.append(NORMAL)
    return tokens, types


def _special_ids(
    tokenizer: dict[str, Any], tokenizer_config: dict[str, Any], config: dict[str, Any], vocab_size: int
) -> dict[str, int]:
    ids: dict[str, int] = {}

    def put(kind: str, token_id: Any) -> None:
        if isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < vocab_size:
            ids.setdefault(kind, token_id)

    for kind in _SPECIAL_KINDS:
        entry = tokenizer_config.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            put(kind, next((t["id"] for t in tokenizer.get("added_tokens", []) if t["content"] == content), None))
    for kind in _SPECIAL_KINDS:
        token_id = config.get(f"{kind}_token_id")
        put(kind, config.get("text_config", {}).get(f"{kind}_token_id") if token_id is None else token_id)
    return ids


def _template_ends(single: list[dict[str, Any]], tokenizer_config: dict[str, Any], add: dict[str, bool]) -> None:
    """The converter's reading of a TemplateProcessing: a special token first adds bos, one last
    adds eos (the cases where they are not the tokenizer's bos/eos are refused)."""
    if len(single) < 2:
        return
    for kind, item in (("bos", single[0]), ("eos", single[-1])):
        special = item.get("SpecialToken", {}).get("id")
        if special is None:
            continue
        named = tokenizer_config.get(f"{kind}_token")
        named = named.get("content") if isinstance(named, dict) else named
        if special != named:
            raise NotSupported(f"the tokenizer adds {special!r} around text, not its {kind}_token {named!r}")
        add[kind] = True


def _add_special(tokenizer: dict[str, Any], tokenizer_config: dict[str, Any]) -> dict[str, bool]:
    add: dict[str, bool] = {}
    post = tokenizer.get("post_processor") or {}
    for processor in post.get("processors", [post]):
        if processor.get("type") == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif processor.get("type") == "TemplateProcessing":
            _template_ends(processor.get("single") or [], tokenizer_config, add)
        elif processor.get("type") in ("RobertaProcessing", "BertProcessing"):
            raise NotSupported(f"a tokenizer post-processor {processor['type']!r} is not written to GGUF here")
    for kind in _SPECIAL_KINDS:
        if isinstance(flag := tokenizer_config.get(f"add_{kind}_token"), bool):
            add.setdefault(kind, flag)
    return add


def _chat_templates(model_dir: Path, tokenizer_config: dict[str, Any]) -> dict[str, Value]:
    source: Any = tokenizer_config.get("chat_template")
    if source is None and (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif source is None:
        source = _read_json(model_dir / "chat_template.json").get("chat_template")
    if source is None or isinstance(source, str):
        return {} if source is None else {"tokenizer.chat_template": string(source)}
    named = {
        "".join(c if c.isascii() and c.isalnum() else "_" for c in t.get("name", "")): t.get("template") for t in source
    }
    out = {f"tokenizer.chat_template.{n}": string(t) for n, t in named.items() if n and n != "default" and t}
    if others := [n for n in named if n and n != "default" and named[n]]:
        out["tokenizer.chat_templates"] = array(STRING, others)
    if isinstance(named.get("default"), str):
        out["tokenizer.chat_template"] = string(named["default"])
    return out


def tokenizer_metadata(model_dir: str | Path, family: str, vocab_size: int) -> dict[str, Value]:
    """`tokenizer.*` metadata for the tokenizer files in `model_dir` (see the module docstring)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json; a GGUF file needs the model's tokenizer")
    tokenizer = _read_json(path)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tokenizer.get("pre_tokenizer")):
        raise NotSupported(f"{path}: only byte-level BPE tokenizers (Qwen's) are written to GGUF")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    config = _read_json(model_dir / "config.json")
    tokens, types = _vocabulary(tokenizer, vocab_size)
    meta = {
        "tokenizer.ggml.model": string("gpt2"),
        "tokenizer.ggml.pre": string(PRE_TOKENIZER[family]),
        "tokenizer.ggml.tokens": array(STRING, tokens),
        "tokenizer.ggml.token_type": array(INT32, types),
        "tokenizer.ggml.merges": array(STRING, _merges(model.get("merges") or [])),
    }
    for kind, token_id in _special_ids(tokenizer, tokenizer_config, config, vocab_size).items():
        meta[f"tokenizer.ggml.{_SPECIAL_KINDS[kind]}_token_id"] = u32(token_id)
    for kind, flag in _add_special(tokenizer, tokenizer_config).items():
        meta[f"tokenizer.ggml.add_{kind}_token"] = boolean(flag)
    return meta | _chat_templates(model_dir, tokenizer_config)
