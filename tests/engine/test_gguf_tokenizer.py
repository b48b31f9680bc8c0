"""A tokenizer read from GGUF metadata that llama.cpp's own converter wrote gives the Hugging Face
tokenizer's ids: the default model's (pre-tokenizer `qwen2`) and the Qwen3.5 test tokenizer's
(`qwen35`), on multilingual text, combining marks, digits, whitespace runs, code and special
tokens inside text; it decodes back, ends on the same ids and renders the same chat prompts.

The metadata is llama.cpp's converter's, read back with our GGUFFile: from the files
scripts/make_gguf_fixtures.py checks in under tests/data/gguf/ (qwen3next-tiny has the default
model's tokenizer, qwen35-tiny the compact test tokenizer), else converted here with
`convert_hf_to_gguf.py --vocab-only` from LLAMA_CPP_DIR, a llama.cpp source tree (llama-cpp-python's
sdist has one in vendor/llama.cpp). The converter names a pre-tokenizer only for tokenizers in its
table of known hashes, so both name it for ours. The key-handling tests at the end build their
metadata by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from byte_level import byte_to_unicode
from hypothesis import given, settings
from hypothesis import strategies as st
from qwen35_tokenizer import ADDED_TOKENS, BPE_VOCAB, COMPACT_VOCAB, QWEN35_VOCAB, write_qwen35_tokenizer

from hybridkv.default_model import default_model_dir
from hybridkv.engine.chat_template import ChatTemplate
from hybridkv.engine.tokenizer import IncrementalDecoder, Tokenizer
from hybridkv.errors import NotSupported
from hybridkv.models.gguf import GGUFFile

TEXTS = (
    "Hello there, how are you? I'VE said it's fine, we'll see.",
    "Zürich, Ελλάδα, Россия, 日本語のテキスト, 中文 and العربية, עברית",
    "नमस्ते दुनिया",  # Devanagari: virama and vowel signs are combining marks (\p{M})
    "q̃ and e\u0301 and ñ and a\u0308\u0301",  # marks NFC cannot compose, can compose, precomposed
    "3.14159 + 42 = 45.14159; 1234567890, 2024-01-31, 1e-9",
    "a  b   c    d\t\te\n\n\nf \n \n g\r\n\r\nh   ",
    "def f(x):\n    return {'k': [x ** 2 for x in range(10)]}  # comment\n\tif a != b: pass\n",
    "emoji 🙂👍🏽 and 👨‍👩‍👧 and ZWJ\u200dthere",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nhello<|im_end|>",
    "text<|endoftext|>more<|im_end|><|im_start|>",
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
FIXTURES = Path(__file__).parents[1] / "data" / "gguf"
# The driver: llama.cpp's converter, told which pre-tokenizer each model has (JOB = "PRE|DIR|OUT").
_CONVERT = """
import runpy, sys
llama_cpp, jobs = sys.argv[1], sys.argv[2:]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion.base import TextModel
convert = runpy.run_path(llama_cpp + "/convert_hf_to_gguf.py")["main"]
for job in jobs:
    pre, model_dir, out = job.split("|")
    TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--vocab-only", "--no-mtp", "--outfile", out]
    convert()
"""


def _convert(tmp: Path, jobs: dict[str, tuple[str, Path]]) -> dict[str, dict[str, Any]]:
    """GGUF metadata (plain values) for each name -> (pre-tokenizer, model dir), by llama.cpp's converter."""
    llama_cpp = os.environ.get("LLAMA_CPP_DIR")
    if not llama_cpp or not (Path(llama_cpp) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("set LLAMA_CPP_DIR to a llama.cpp source tree to convert the test tokenizers to GGUF")
    args = [f"{pre}|{model_dir}|{tmp / name}.gguf" for name, (pre, model_dir) in jobs.items()]
    done = subprocess.run([sys.executable, "-c", _CONVERT, llama_cpp, *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"llama.cpp's converter failed:\n{done.stderr[-3000:]}")
    return {name: _read(tmp / f"{name}.gguf") for name in jobs}


def _read(path: Path) -> dict[str, Any]:
    with GGUFFile(path) as gguf:
        return dict(gguf.metadata)


def _qwen35_dir(path: Path, vocab_size: int) -> Path:
    """The Qwen3.5 test tokenizer with a text-only Qwen3.5 config.json (what the converter reads)."""
    import transformers
    from qwen35_reference import TINY_TEXT

    config = transformers.Qwen3_5TextConfig(**{**TINY_TEXT, "vocab_size": vocab_size})
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(path)
    return write_qwen35_tokenizer(path, compact=vocab_size == COMPACT_VOCAB)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """name -> (GGUF metadata, the Hugging Face model dir it was converted from)."""
    tmp = tmp_path_factory.mktemp("gguf-tokenizers")
    jobs = {"default": ("qwen2", default_model_dir()), "qwen35": ("qwen35", _qwen35_dir(tmp / "qwen35", COMPACT_VOCAB))}
    files = {"default": FIXTURES / "qwen3next-tiny-q8_0.gguf", "qwen35": FIXTURES / "qwen35-tiny-q8_0.gguf"}
    if all(path.is_file() for path in files.values()):
        metadata = {name: _read(path) for name, path in files.items()}
    else:
        metadata = _convert(tmp, jobs)
    return {name: (metadata[name], model_dir) for name, (_, model_dir) in jobs.items()}


class Case(NamedTuple):
    metadata: dict[str, Any]
    ours: Tokenizer  # from the GGUF metadata
    hf: Any  # transformers' AutoTokenizer on the model directory the GGUF was converted from


@pytest.fixture(scope="module", params=["default", "qwen35"])
def case(request: pytest.FixtureRequest, converted: dict[str, tuple[dict[str, Any], Path]]) -> Case:
    from transformers import AutoTokenizer

    metadata, model_dir = converted[request.param]
    return Case(metadata, Tokenizer.from_gguf_metadata(metadata), AutoTokenizer.from_pretrained(model_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_transformers(case: Case, text: str) -> None:
    _, ours, hf = case
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids) == unicodedata.normalize("NFC", text)


_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</tool_call>"]
_ODD = " \t\n\r\u00a00123456789'sSvVeE\u0301\u0308\u093f\u094d\u200d\u3000.,!?-_=+(){}[]<>|"


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.text(st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(_ODD))),
            st.sampled_from(_SPECIALS),
        ),
        max_size=8,
    )
)
def test_any_text_encodes_as_transformers(case: Case, pieces: list[str]) -> None:
    _, ours, hf = case
    text = "".join(pieces)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_ends_on_the_same_ids_as_the_model_directory(converted: dict[str, tuple[dict[str, Any], Path]]) -> None:
    for metadata, model_dir in converted.values():
        ours = Tokenizer.from_gguf_metadata(metadata)
        assert ours.eos_token_ids == Tokenizer.from_dir(model_dir).eos_token_ids
        assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}


def test_added_tokens_keep_their_ids_and_role(case: Case) -> None:
    _, ours, hf = case
    for token, token_id in hf.get_added_vocab().items():
        assert ours.token_to_id(token) == token_id
        assert ours.encode(f"a{token}b")[1] == token_id  # one token inside text, not spelt out
    # Qwen3.5's <think> and <tool_call> are user-defined in the GGUF: skipping special tokens keeps them
    ids = ours.encode("<|im_start|>assistant\n<think>\nx</think><tool_call></tool_call><|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_streamed_pieces_join_to_the_decoded_text(case: Case) -> None:
    _, ours, hf = case
    for text in TEXTS:
        ids = ours.encode(text)
        decoder = IncrementalDecoder(ours)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == hf.decode(ids, skip_special_tokens=True)


def test_fim_tokens_are_control_tokens_in_the_gguf(converted: dict[str, tuple[dict[str, Any], Path]]) -> None:
    # The converter writes every <|...|> added token as control, so decoding skips <|fim_pad|> as
    # llama.cpp does, though Qwen3.5's tokenizer_config marks it not special.
    metadata, _ = converted["qwen35"]
    ours = Tokenizer.from_gguf_metadata(metadata)
    assert ("<|fim_pad|>", False) in ADDED_TOKENS
    assert ours.decode(ours.encode("a<|fim_pad|>b"), skip_special_tokens=True) == "ab"


def test_the_pre_tokenizer_name_decides_how_marks_split(converted: dict[str, tuple[dict[str, Any], Path]]) -> None:
    metadata, _ = converted["qwen35"]
    assert metadata["tokenizer.ggml.pre"] == "qwen35"
    qwen35 = Tokenizer.from_gguf_metadata(metadata)
    qwen2 = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "qwen2"})
    assert len(qwen35.encode(" नमस्ते")) == 1 and len(qwen35.encode("q̃")) == 1
    assert len(qwen2.encode(" नमस्ते")) > 1 and len(qwen2.encode("q̃")) > 1  # \p{L}+ cuts before each mark


def test_gpt2_pre_tokenizer_splits_as_gpt2s_byte_level(converted: dict[str, tuple[dict[str, Any], Path]]) -> None:
    import tokenizers

    # The converter writes the same keys whatever the pre-tokenizer is called: only the name changes.
    metadata, model_dir = converted["default"]
    metadata = {**metadata, "tokenizer.ggml.pre": "gpt-2"}
    reference = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reference.normalizer = None  # GPT-2's tokenizer.json: no normaliser, ByteLevel with its own regex
    reference.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    ours = Tokenizer.from_gguf_metadata(metadata)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_chat_template_renders_as_transformers(case: Case) -> None:
    metadata, _, hf = case
    template = ChatTemplate.from_gguf_metadata(metadata)
    assert template is not None and template.special_tokens["eos_token"] == "<|im_end|>"
    for turns in (MESSAGES[:2], MESSAGES):
        expected = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        assert template.render(turns) == expected


@pytest.mark.slow
def test_full_size_qwen35_vocabulary_keeps_ids_past_the_gap(tmp_path: Path) -> None:
    # 248,320 ids, most of them the converter's [PADn] fill (type unused): ids stay put, pads decode to "".
    from transformers import AutoTokenizer

    metadata = _convert(tmp_path, {"qwen35": ("qwen35", _qwen35_dir(tmp_path / "qwen35", QWEN35_VOCAB))})["qwen35"]
    ours, hf = Tokenizer.from_gguf_metadata(metadata), AutoTokenizer.from_pretrained(tmp_path / "qwen35")
    assert len(metadata["tokenizer.ggml.tokens"]) == QWEN35_VOCAB
    assert ours.eos_token_ids == {248046, 248044}
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    absent = [BPE_VOCAB, 100_000, 248_043, 248_070, 248_319]
    assert ours.decode(absent) == hf.decode(absent) == ""


# Key handling, on metadata written here: a byte alphabet and a few added tokens.
def _metadata(**keys: Any) -> dict[str, Any]:
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>", "<tool_call>", "[PAD263]"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": [*byte_to_unicode().values(), "Ġt", "Ġth", *added],
        "tokenizer.ggml.token_type": [1] * 258 + [3, 3, 3, 3, 4, 5],
        "tokenizer.ggml.merges": ["Ġ t", "Ġt h"],
        **{f"tokenizer.ggml.{k}": v for k, v in keys.items()},
    }


def test_eos_ids_come_from_the_eos_eot_and_eom_keys_and_the_end_texts() -> None:
    assert Tokenizer.from_gguf_metadata(_metadata()).eos_token_ids == {258, 260}  # by text
    tok = Tokenizer.from_gguf_metadata(_metadata(eos_token_id=259, eot_token_id=261, eom_token_id=262))
    assert tok.eos_token_ids == {258, 259, 260, 261, 262}
    assert Tokenizer.from_gguf_metadata(_metadata(eos_token_id=999)).eos_token_ids == {258, 260}  # out of range


def test_add_bos_token_adds_it_only_when_special_tokens_are_asked_for() -> None:
    tok = Tokenizer.from_gguf_metadata(_metadata(bos_token_id=258, add_bos_token=True))
    assert tok.backend.encode(" th").ids == [258, 257]
    assert tok.encode(" th") == [257]
    assert Tokenizer.from_gguf_metadata(_metadata(bos_token_id=258)).backend.encode(" th").ids == [257]


def test_unused_tokens_are_left_out() -> None:
    tok = Tokenizer.from_gguf_metadata(_metadata())
    assert tok.token_to_id("[PAD263]") is None and tok.decode([263]) == ""
    assert tok.decode(tok.encode("a<tool_call>b<|im_end|>"), skip_special_tokens=True) == "a<tool_call>b"


def test_chat_template_with_named_templates_and_token_strings() -> None:
    metadata = {
        **_metadata(bos_token_id=258, eos_token_id=260, padding_token_id=258),
        "tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        "tokenizer.chat_templates": ["tool_use"],
        "tokenizer.chat_template.tool_use": "tools: {{ tools | length }}",
    }
    template = ChatTemplate.from_gguf_metadata(metadata)
    assert template is not None
    assert template.special_tokens == {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    assert template.render([{"role": "user", "content": "hi"}]) == "<|endoftext|>hi<|im_end|>"
    assert template.render([{"role": "user", "content": "hi"}], tools=[{"name": "f"}]) == "tools: 1"
    assert ChatTemplate.from_gguf_metadata(_metadata()) is None


def test_unknown_pre_tokenizer_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(NotSupported, match=r"'llama-bpe' is not supported.*qwen2, qwen35, gpt-2"):
        Tokenizer.from_gguf_metadata(_metadata(pre="llama-bpe"))
    with pytest.raises(NotSupported, match=r"tokenizer.ggml.pre None"):
        Tokenizer.from_gguf_metadata({k: v for k, v in _metadata().items() if k != "tokenizer.ggml.pre"})


def test_other_tokenizer_models_are_refused_naming_them() -> None:
    with pytest.raises(NotSupported, match=r"tokenizer.ggml.model 'llama' is not supported"):
        Tokenizer.from_gguf_metadata(_metadata(model="llama"))


def test_inconsistent_metadata_is_an_error() -> None:
    with pytest.raises(ValueError, match="264 tokenizer.ggml.tokens but 3 token types"):
        Tokenizer.from_gguf_metadata(_metadata(token_type=[1, 1, 1]))
    with pytest.raises(ValueError, match=r"merges\[0\] = 'Ġt' is not 'left right'"):
        Tokenizer.from_gguf_metadata(_metadata(merges=["Ġt"]))
