"""The Qwen3.5 test tokenizer reads the same through our Tokenizer as through transformers'
Qwen3_5Tokenizer, special tokens sit at Qwen3.5's ids, and marks stay with their letters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from qwen35_tokenizer import ADDED_IDS, ADDED_TOKENS, BPE_VOCAB, EOS_IDS, write_qwen35_tokenizer

from hybridkv.engine.tokenizer import Tokenizer

TEXTS = (
    "Hello there, how are you?",
    "नमस्ते दुनिया",  # Devanagari: virama and vowel signs are combining marks (\p{M})
    "q̃ and e\u0301 and ñ",  # a mark NFC cannot compose, one it can, a precomposed letter
    "Zürich 2024: 3.14 + 42 = 45.14\n\n\tindented\r\nline",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nhello<|im_end|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "emoji 🙂 and 中文 and العربية",
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    path = write_qwen35_tokenizer(tmp_path_factory.mktemp("qwen35-tokenizer"))
    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_transformers(tokenizers: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = tokenizers
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_transformers_builds_it_with_the_qwen35_tokenizer_class(tokenizers: tuple[Tokenizer, Any]) -> None:
    assert type(tokenizers[1]).__name__ == "Qwen3_5Tokenizer"


def test_added_tokens_have_qwen35_ids(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = tokenizers
    assert len(ADDED_TOKENS) == 26 and ADDED_IDS["<|endoftext|>"] == 248044 and ADDED_IDS["</think>"] == 248069
    assert (ADDED_IDS["<|im_start|>"], ADDED_IDS["<|im_end|>"], ADDED_IDS["<think>"]) == (248045, 248046, 248068)
    assert (ADDED_IDS["<tool_call>"], ADDED_IDS["</tool_call>"]) == (248058, 248059)
    for token, token_id in ADDED_IDS.items():
        assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token) == token_id
        assert ours.encode(f"a{token}b")[1] == token_id  # one token inside text, not spelt out
    assert ours.eos_token_ids == set(EOS_IDS) == {248046, 248044}
    assert hf.eos_token == "<|im_end|>"


def test_think_and_tool_tags_survive_skipping_special_tokens(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, _ = tokenizers
    ids = ours.encode("<|im_start|>assistant\n<think>\nx</think><tool_call></tool_call><|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx</think><tool_call></tool_call>"


def test_combining_marks_stay_with_their_letters(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, _ = tokenizers
    # whole-word tokens exist; Qwen3's \p{L}+ pre-tokenizer would cut before each mark and never reach them
    assert len(ours.encode("नमस्ते")) == 1 and len(ours.encode(" नमस्ते")) == 1 and len(ours.encode("q̃")) == 1
    assert ours.encode("e\u0301") == ours.encode("é")  # NFC first


def test_ids_past_the_small_vocabulary_decode_to_nothing(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = tokenizers
    absent = [BPE_VOCAB, 100_000, 248_043, 248_070, 248_319]
    assert ours.decode(absent) == hf.decode(absent) == ""


def test_compact_ids_follow_the_bpe_tokens(tmp_path: Path) -> None:
    ours = Tokenizer.from_dir(write_qwen35_tokenizer(tmp_path, compact=True))
    assert ours.token_to_id("<|endoftext|>") == BPE_VOCAB and ours.token_to_id("</think>") == BPE_VOCAB + 25
    assert ours.eos_token_ids == {BPE_VOCAB, BPE_VOCAB + 2}
