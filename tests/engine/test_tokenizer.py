"""Tokenizer loading and streaming decode: pieces join to the full text, never half a character."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from byte_level import IM_END_ID
from byte_level import byte_tokenizer as make_byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.default_model import default_model_dir
from hybridkv.engine.tokenizer import IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return make_byte_tokenizer()


def _stream(tok: Tokenizer, ids: list[int], context: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(tok, context=context or [])
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@settings(max_examples=200, deadline=None)
# Special-token strings ("<|im_end|>", which hypothesis draws from our source) encode to special ids
# that the stream skips by design, so such texts are not round-trips.
@given(
    text=st.text(st.characters(exclude_characters="\ufffd", exclude_categories=["Cs"]), max_size=40).filter(
        lambda t: "<|" not in t
    )
)
def test_streamed_pieces_join_to_the_text_and_never_split_a_character(byte_tokenizer: Tokenizer, text: str) -> None:
    pieces = _stream(byte_tokenizer, byte_tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_multibyte_character_appears_with_its_last_byte(byte_tokenizer: Tokenizer) -> None:
    ids = list("a中".encode())  # 'a' then three bytes e4 b8 ad
    assert _stream(byte_tokenizer, ids) == ["a", "", "", "中", ""]


def test_invalid_bytes_come_out_as_replacement_characters_once_settled(byte_tokenizer: Tokenizer) -> None:
    assert _stream(byte_tokenizer, [0x80, ord("A")]) == ["", "\ufffdA", ""]
    assert _stream(byte_tokenizer, [ord("A"), 0xE4]) == ["A", "", "\ufffd"]  # flush gives up on it


def test_special_tokens_are_skipped_in_the_stream(byte_tokenizer: Tokenizer) -> None:
    assert "".join(_stream(byte_tokenizer, [ord("h"), IM_END_ID, ord("i")])) == "hi"


def test_context_keeps_a_leading_space_that_a_metaspace_decoder_would_drop(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.encode("hello world") == [0, 1]
    assert tok.decode([1]) == "world"  # alone, the space is gone
    assert "".join(_stream(tok, [1], context=[0])) == " world"


def test_eos_ids_are_gathered_from_every_config_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(default_model_dir() / "tokenizer.json", model)
    (model / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    im_end = Tokenizer.from_dir(default_model_dir()).token_to_id("<|im_end|>")
    assert Tokenizer.from_dir(model).eos_token_ids == {7, 8, 9, im_end}
    (model / "tokenizer_config.json").unlink()
    (model / "generation_config.json").unlink()
    assert Tokenizer.from_dir(model).eos_token_ids == {7}
    # a vision-language config.json (Qwen3.5) names it in its text_config
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"eos_token_id": 6}}))
    assert Tokenizer.from_dir(model).eos_token_ids == {6}


def test_a_directory_without_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_the_test_byte_alphabet_is_the_byte_level_one() -> None:
    from byte_level import byte_to_unicode
    from tokenizers import pre_tokenizers

    assert sorted(byte_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
