"""The shipped default model: as good as the README says, and a Qwen3-Next checkpoint as transformers reads it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from hybridkv import CacheConfig, CachedModel
from hybridkv.default_model import default_model_dir
from hybridkv.engine.chat_template import ChatTemplate
from hybridkv.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

README = Path(__file__).parents[1] / "README.md"
HELDOUT = Path(__file__).parent / "data" / "default_model_heldout.txt"
# As scripts/train_default_model.py measures it: the first EVAL_TOKENS held-out tokens in windows
# of SEQ_LEN, each a fresh sequence, every token but a window's first predicted.
SEQ_LEN, EVAL_TOKENS = 256, 16384
F32_TOL = 1e-4  # max |ours - transformers| as a share of max |logit|, as in tests/models/test_parity.py


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def heldout_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))


def readme_perplexity() -> float:
    match = re.search(r"held-out perplexity is \*\*([0-9.]+)\*\*", README.read_text(encoding="utf-8"))
    assert match, "README.md no longer states the default model's held-out perplexity"
    return float(match.group(1))


def test_heldout_perplexity_is_the_one_the_readme_states(heldout_ids: list[int]) -> None:
    windows = torch.tensor(heldout_ids[:EVAL_TOKENS]).view(-1, SEQ_LEN)
    cm = CachedModel.load(cache=CacheConfig(max_model_len=SEQ_LEN, max_sequences=16))
    total = 0.0
    for part in windows.split(16):
        seqs = [cm.new_sequence() for _ in part]
        logits = cm.feed(dict(zip(seqs, part.tolist(), strict=True)), logits="all")
        for seq, window in zip(seqs, part, strict=True):
            total += F.cross_entropy(logits[seq][:-1], window[1:], reduction="sum").item()
            cm.release(seq)
    perplexity = math.exp(total / (windows.numel() - windows.shape[0]))
    assert perplexity == pytest.approx(readme_perplexity(), rel=0.01)


def test_transformers_loads_every_weight_and_computes_our_logits(heldout_ids: list[int]) -> None:
    model, info = transformers.Qwen3NextForCausalLM.from_pretrained(default_model_dir(), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.num_experts > 1 and model.config.shared_expert_intermediate_size > 0
    ids = heldout_ids[1000:1300]  # longer than a training window
    with torch.no_grad():
        theirs = model.eval()(torch.tensor([ids]), use_cache=False).logits[0]
    cm = CachedModel.load(cache=CacheConfig(max_model_len=512, max_sequences=1))
    seq = cm.new_sequence()
    ours = torch.cat([cm.feed({seq: ids[:200]})[seq], cm.feed({seq: ids[200:]})[seq]])  # prefill, then more
    err, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert err <= F32_TOL * scale, f"max |diff| {err:.3g} > {F32_TOL} × max |logit| {scale:.3g}"


def test_tensor_names_and_shapes_are_what_transformers_saves(tmp_path: Path) -> None:
    config = transformers.Qwen3NextConfig.from_pretrained(default_model_dir())
    transformers.Qwen3NextForCausalLM(config).save_pretrained(tmp_path)

    def shapes(path: Path) -> dict[str, tuple[int, ...]]:
        with safe_open(str(path), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118

    assert shapes(default_model_dir() / "model.safetensors") == shapes(tmp_path / "model.safetensors")


def test_the_shipped_files_fit_in_25_mb() -> None:
    files = list(default_model_dir().iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20


def test_tokenizer_is_byte_level_bpe_with_qwen_special_tokens(tokenizer: Tokenizer) -> None:
    text = "The function returns 42 — ünïcödé, 中文 🙂\n\tdone"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    english = "The function returns a new list of the items in the sequence."
    assert len(tokenizer.encode(english)) < len(english) / 3  # learnt merges: about a word per token
    im_start, im_end, endoftext = (tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [im_start, *tokenizer.encode("user"), im_end]
    assert tokenizer.eos_token_ids == {im_end, endoftext}
    theirs = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    assert theirs.encode(text + "<|im_end|>", add_special_tokens=False) == tokenizer.encode(text + "<|im_end|>")
    assert (theirs.eos_token, theirs.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_chat_template_writes_chatml_as_transformers_does() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    ours = ChatTemplate.from_dir(default_model_dir())
    assert ours is not None
    prompt = ours.render(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    )
    theirs = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
