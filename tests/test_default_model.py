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
# The shipped MTP block's first draft equals the next greedy token in about three steps of four
# (scripts/train_mtp.py measures 0.746 on 16 prompts); the floor leaves room for near ties.
MTP_FIRST_DRAFT_FLOOR = 0.6
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

    ours = shapes(default_model_dir() / "model.safetensors")
    main = {name: shape for name, shape in ours.items() if not name.startswith("mtp.")}
    assert main == shapes(tmp_path / "model.safetensors")  # transformers reads no MTP block: ours is extra
    D = config.hidden_size
    assert ours["mtp.fc.weight"] == (D, 2 * D) and ours["mtp.layers.0.self_attn.o_proj.weight"] == (D, 256)
    mtp_bytes = sum(4 * math.prod(shape) for name, shape in ours.items() if name.startswith("mtp."))
    assert mtp_bytes <= 3.5e6


def test_the_trained_mtp_block_drafts_what_greedy_decoding_then_says(heldout_ids: list[int]) -> None:
    """Greedy decoding from held-out prompts; before each step the MTP block drafts the token
    after the pending one. A random guess is right 1 time in 4,096."""
    prompts = [heldout_ids[i * SEQ_LEN : i * SEQ_LEN + 64] for i in range(8)]
    cm = CachedModel.load(cache=CacheConfig(max_model_len=128, max_sequences=8), mtp=True)
    seqs = [cm.new_sequence() for _ in prompts]
    last = cm.feed(dict(zip(seqs, prompts, strict=True)), logits="last")
    pending = {seq: int(last[seq][-1].argmax()) for seq in seqs}
    hits = steps = 0
    for _ in range(32):
        drafts = cm.draft_mtp(pending, 1)
        last = cm.feed({seq: [token] for seq, token in pending.items()}, logits="last")
        pending = {seq: int(last[seq][-1].argmax()) for seq in seqs}
        hits += sum(drafts[seq][0] == pending[seq] for seq in seqs)
        steps += len(seqs)
    cm.cache.check_integrity()
    assert hits / steps >= MTP_FIRST_DRAFT_FLOOR, f"first drafts accepted {hits}/{steps}"


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
