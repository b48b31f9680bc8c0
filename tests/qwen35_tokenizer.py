"""A small Qwen3.5 tokenizer for tests: transformers' `Qwen3_5Tokenizer` (byte-level BPE, NFC, the
pre-tokenizer that keeps combining marks with their letters) over a few hundred tokens, with
Qwen3.5's 26 added tokens at their real ids and its chat template (3.5 or 3.6).

    ids 0..255          one token per byte (GPT-2's byte alphabet, as in byte_level.py)
    ids 256..           merges spelling WORDS (so multi-byte tokens and \\p{M} grouping show up)
    ids ..248043        absent: no token has them (the real vocabulary's BPE tokens)
    ids 248044..248069  the added tokens, as Qwen3.5 numbers them (ADDED_TOKENS)
    ids 248070..248319  absent: later added tokens and the model head's padding (V = 248,320)

A model for this tokenizer needs `vocab_size=QWEN35_VOCAB` (248,320, as the real models), and
decoding an absent id gives "". Tests that want a small model use `compact=True`: the same
tokens, with the added tokens right after the merges, so `COMPACT_VOCAB` rows suffice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from byte_level import byte_to_unicode

DATA = Path(__file__).parent / "data"
TEMPLATES = {"3.5": DATA / "qwen3_5_chat_template.jinja", "3.6": DATA / "qwen3_6_chat_template.jinja"}
QWEN35_VOCAB = 248_320  # rows of Qwen3.5's embedding and LM head

# Qwen3.5's added tokens from 248044 on, in id order, and whether each is `special` (skipped when
# decoding with skip_special_tokens). Same order and flags as Qwen3's 151643..151668, shifted by 96401:
# 248044/45/46/68/69 and the eos pair are in docs/reference (qwen3.5.md §4); 248053/54/56/57 in
# transformers' Qwen3_5Config (vision_start/vision_end/image/video token ids); 248058/59
# (<tool_call>, </tool_call>, special false) in Qwen/Qwen3.5-397B-A17B's tokenizer_config.json;
# 248063/64/65 (<|fim_pad|>, <|repo_name|>, <|file_sep|>) in llama.cpp's end-of-generation list for
# Qwen3.6 GGUFs. Ids 248070.. (about 7 more in the real file) are not known here and left out.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 248044
    ("<|im_start|>", True),  # 248045
    ("<|im_end|>", True),  # 248046
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),  # 248053
    ("<|vision_end|>", True),  # 248054
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),  # 248056
    ("<|video_pad|>", True),  # 248057
    ("<tool_call>", False),  # 248058
    ("</tool_call>", False),  # 248059
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),  # 248063
    ("<|repo_name|>", False),  # 248064
    ("<|file_sep|>", False),  # 248065
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),  # 248068
    ("</think>", False),  # 248069
)
FIRST_ADDED_ID = 248_044
ADDED_IDS = {token: FIRST_ADDED_ID + i for i, (token, _) in enumerate(ADDED_TOKENS)}
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = ADDED_IDS["<|endoftext|>"], ADDED_IDS["<|im_start|>"], ADDED_IDS["<|im_end|>"]
THINK_ID, END_THINK_ID = ADDED_IDS["<think>"], ADDED_IDS["</think>"]
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)  # generation_config.json's order

# Words that become single tokens. "नमस्ते" has combining marks (virama, vowel sign) between its
# letters and "q̃" a tilde that NFC cannot compose: one token each only because the Qwen3.5
# pre-tokenizer's [\p{L}\p{M}]+ keeps marks with letters (Qwen3's \p{L}+ cut before each mark).
WORDS = (
    "Ġthe", "Ġand", "ing", "Ġhello", "ĠHello", "Ġthere", "Ġyou", "Ġweather", "ĠParis", "think",
    "user", "assistant", "system", "ĊĊ", "Ġनमस्ते", "नमस्ते", "q̃",
)  # fmt: skip


def _byte_spelling(word: str) -> str:
    """`word` in the byte alphabet; Ġ and Ċ (space, newline) are written as such already."""
    alphabet = byte_to_unicode()
    return "".join(alphabet[b] for b in word.replace("Ġ", " ").replace("Ċ", "\n").encode())


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte tokens, then for each word the merges that spell it: BPE splits the word with the
    merges so far, and the first two pieces become the next merge, until it is one token."""
    from tokenizers.models import BPE

    vocab = {char: b for b, char in byte_to_unicode().items()}
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        while len(pieces := [t.value for t in BPE(vocab, merges).tokenize(_byte_spelling(word))]) > 1:
            merges.append((pieces[0], pieces[1]))
            vocab[pieces[0] + pieces[1]] = len(vocab)
    return vocab, merges


BPE_VOCAB = len(_vocab_and_merges()[0])
COMPACT_VOCAB = BPE_VOCAB + len(ADDED_TOKENS)


def added_ids(compact: bool = False) -> dict[str, int]:
    """Added token -> id: the real ids, or (compact) right after the BPE tokens."""
    first = BPE_VOCAB if compact else FIRST_ADDED_ID
    return {token: first + i for i, (token, _) in enumerate(ADDED_TOKENS)}


def qwen35_backend(compact: bool = False):  # -> tokenizers.Tokenizer
    """The `tokenizers` backend transformers' Qwen3_5Tokenizer builds over this vocabulary, with
    the added tokens at their ids (they are in the BPE vocabulary too, which is how ids past the
    end of a small vocabulary stay put)."""
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    vocab, merges = _vocab_and_merges()
    vocab.update(added_ids(compact))
    backend = Qwen3_5Tokenizer(vocab=vocab, merges=merges).backend_tokenizer
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    return backend


def write_qwen35_tokenizer(path: Path, template: Literal["3.5", "3.6"] = "3.5", compact: bool = False) -> Path:
    """tokenizer.json, tokenizer_config.json (the chat template, eos <|im_end|>) and
    generation_config.json (eos [<|im_end|>, <|endoftext|>]) in `path`, as a Qwen3.5 model has them."""
    path.mkdir(parents=True, exist_ok=True)
    ids = added_ids(compact)
    qwen35_backend(compact).save(str(path / "tokenizer.json"))
    decoder = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token, special in ADDED_TOKENS
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": TEMPLATES[template].read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path
