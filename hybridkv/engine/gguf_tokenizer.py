"""Our tokenizer and chat template from a GGUF file's metadata, as llama.cpp's converter writes it
(used by `Tokenizer.from_gguf_metadata` and `ChatTemplate.from_gguf_metadata`).

Keys read (a plain `Mapping[str, Any]`, e.g. `GGUFFile(path).metadata`):

    tokenizer.ggml.model            "gpt2" (byte-level BPE); any other is NotSupported
    tokenizer.ggml.pre              the pre-tokenizer, by llama.cpp's name (PRE_TOKENIZERS)
    tokenizer.ggml.tokens           token text by id (GPT-2's byte alphabet, as in tokenizer.json)
    tokenizer.ggml.token_type       per id: 1 normal, 3 control, 4 user-defined, 5 unused, ...
    tokenizer.ggml.merges           "left right" strings, by rank
    tokenizer.ggml.{bos,eos,eot,eom,padding,unknown,seperator,cls,mask}_token_id
    tokenizer.ggml.add_bos_token, add_eos_token
    tokenizer.chat_template, tokenizer.chat_templates + tokenizer.chat_template.NAME

Control and user-defined tokens become added tokens (matched whole inside text, never split),
control ones `special` (dropped by `skip_special_tokens`). The converter writes every `<|...|>`
token as control, so `<|fim_prefix|>` and its kin are skipped on decode here (as in llama.cpp)
although transformers keeps them. Unused tokens (the converter's `[PADn]` fill for ids the
tokenizer lacks) are left out, so those ids decode to "" as in transformers.

Ids equal the Hugging Face tokenizer's, so normalisation follows transformers where llama.cpp
differs: Qwen's tokenizers apply NFC before pre-tokenizing (llama.cpp does not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from hybridkv.errors import NotSupported

# llama.cpp's llama_token_type (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer regexes of the tokenizer.json files these names stand for; llama.cpp
# (llama-vocab.cpp, llm_tokenizer_bpe) spells the same patterns with (?:'[sS]|...) for (?i:'s|...).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letters keep their combining marks ([\p{L}\p{M}]+), LLAMA_VOCAB_PRE_TYPE_QWEN35.
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class PreTokenizer:
    """How text is cut before BPE: NFC first or not, then one split regex (matches isolated)."""

    regex: str
    nfc: bool


PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    "qwen2": PreTokenizer(_QWEN2_REGEX, nfc=True),  # Qwen2, Qwen3, Qwen3-Next (ollama writes it for Qwen3.5 too)
    "qwen35": PreTokenizer(_QWEN35_REGEX, nfc=True),  # Qwen3.5 / 3.6
    "gpt-2": PreTokenizer(_GPT2_REGEX, nfc=False),  # GPT-2's own ByteLevel split
}

# End-of-generation token texts llama.cpp recognises (llama-vocab.cpp), as far as a byte-level
# BPE vocabulary has them: generation stops there even when no *_token_id key names them.
_END_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>"})
# The special-token strings transformers passes to chat templates: name -> tokenizer.ggml.KIND_token_id.
_TEMPLATE_TOKENS = {
    "bos_token": "bos",
    "eos_token": "eos",
    "unk_token": "unknown",
    "sep_token": "seperator",  # sic, as llama.cpp spells the key
    "pad_token": "padding",
    "cls_token": "cls",
    "mask_token": "mask",
}


def gguf_eos_ids(metadata: Mapping[str, Any]) -> set[int]:
    """End-of-sequence ids: the eos, eot and eom ids, plus control tokens llama.cpp ends
    generation on by their text (Qwen's <|im_end|> and <|endoftext|> both)."""
    tokens = _strings(metadata, "tokenizer.ggml.tokens")
    types = _token_types(metadata, len(tokens))
    eos = {token_id for key in ("eos", "eot", "eom") if (token_id := _token_id(metadata, key, len(tokens))) is not None}
    return eos | {i for i, text in enumerate(tokens) if types[i] == CONTROL and text in _END_TEXTS}


def gguf_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` the metadata describes (NotSupported for a tokenizer model or
    pre-tokenizer not handled here, ValueError for inconsistent metadata)."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotSupported(
            f"GGUF tokenizer.ggml.model {model!r} is not supported; hybridkv reads 'gpt2' (byte-level BPE) tokenizers"
        )
    pre_name = metadata.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)  # type: ignore[arg-type]
    if pre is None:
        raise NotSupported(
            f"GGUF tokenizer.ggml.pre {pre_name!r} is not supported; hybridkv knows {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = _strings(metadata, "tokenizer.ggml.tokens")
    types = _token_types(metadata, len(tokens))
    vocab = {text: i for i, text in enumerate(tokens) if types[i] != UNUSED}
    bpe = models.BPE(
        vocab=vocab,
        merges=[_merge(i, m) for i, m in enumerate(_strings(metadata, "tokenizer.ggml.merges"))],
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    backend = tokenizers.Tokenizer(bpe)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pre.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = _post_processor(metadata, tokens)
    # In the BPE vocabulary already, so each keeps its id; added in id order.
    added = [i for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)]
    backend.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False) for i in added])
    return backend


def gguf_chat_templates(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Template sources by name: "default" from `tokenizer.chat_template`, others from
    `tokenizer.chat_template.NAME` for each NAME in `tokenizer.chat_templates`."""
    templates: dict[str, str] = {}
    if isinstance(default := metadata.get("tokenizer.chat_template"), str):
        templates["default"] = default
    for name in metadata.get("tokenizer.chat_templates") or ():
        if isinstance(source := metadata.get(f"tokenizer.chat_template.{name}"), str):
            templates[str(name)] = source
    return templates


def gguf_template_tokens(metadata: Mapping[str, Any]) -> dict[str, str]:
    """The special-token strings transformers gives templates (bos_token, eos_token, ...), for
    the ids the metadata names."""
    tokens = _strings(metadata, "tokenizer.ggml.tokens")
    named = {name: _token_id(metadata, kind, len(tokens)) for name, kind in _TEMPLATE_TOKENS.items()}
    return {name: tokens[token_id] for name, token_id in named.items() if token_id is not None}


def _post_processor(metadata: Mapping[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, and bos/eos around the text when add_bos_token/add_eos_token say so
    (only when special tokens are asked for: `Tokenizer.encode` adds none)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    ends: dict[str, int] = {}  # "bos"/"eos" -> id
    for end in ("bos", "eos"):
        token_id = _token_id(metadata, end, len(tokens))
        if metadata.get(f"tokenizer.ggml.add_{end}_token") and token_id is not None:
            ends[end] = token_id
    if not ends:
        return byte_level

    def around(sequence: str, type_id: int) -> str:
        bos = [tokens[ends["bos"]]] if "bos" in ends else []
        eos = [tokens[ends["eos"]]] if "eos" in ends else []
        return " ".join(f"{part}:{type_id}" for part in [*bos, f"${sequence}", *eos])

    special = {tokens[token_id]: token_id for token_id in ends.values()}
    template = processors.TemplateProcessing(
        single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}", special_tokens=list(special.items())
    )
    return processors.Sequence([byte_level, template])


def _token_id(metadata: Mapping[str, Any], name: str, vocab_size: int) -> int | None:
    """`tokenizer.ggml.{name}_token_id`, or None when absent or out of range (llama.cpp ignores it then)."""
    value = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    token_id = int(value)
    return token_id if 0 <= token_id < vocab_size else None


def _strings(metadata: Mapping[str, Any], key: str) -> list[str]:
    values = metadata.get(key)
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"GGUF metadata {key} must be a list of strings, got {type(values).__name__}")
    if values and not isinstance(values[0], str):
        raise ValueError(f"GGUF metadata {key} must hold strings, got {type(values[0]).__name__}")
    return list(values)


def _token_types(metadata: Mapping[str, Any], n_tokens: int) -> list[int]:
    """Per-token types; all normal when the key is absent (llama.cpp's default too)."""
    raw = metadata.get("tokenizer.ggml.token_type")
    if raw is None:
        return [NORMAL] * n_tokens
    types = [int(t) for t in raw]
    if len(types) != n_tokens:
        raise ValueError(f"GGUF metadata has {n_tokens} tokenizer.ggml.tokens but {len(types)} token types")
    return types


def _merge(rank: int, merge: str) -> tuple[str, str]:
    # As llama.cpp splits them: at the first space after the first character.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"GGUF tokenizer.ggml.merges[{rank}] = {merge!r} is not 'left right'")
    return merge[:cut], merge[cut + 1 :]
