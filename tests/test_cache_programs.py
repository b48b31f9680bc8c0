"""Random programs of cache operations: every logit equals a fresh transformers recompute and
the bookkeeping stays whole after every step."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_reference import attention_reads, hf_logits, make_hf_model, max_rel_err, save_checkpoint
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mtp_reference import add_mtp, mtp_tensors, twin_draft
from qwen35_reference import make_qwen35, qwen35_logits, save_qwen35
from safetensors.torch import save_file

from hybridkv import CacheConfig, CachedModel, CacheFull
from hybridkv.models.gguf_checkpoint import GGUFCheckpoint, GGUFTensors
from hybridkv.ops.quant.linear import float_activations

MAX_LEN = 48
VOCAB = 128


@functools.cache
def reference(family: str) -> tuple[Any, Path, Any]:
    """(transformers model, checkpoint dir, its no-cache logits function) of a family's tiny model."""
    path = Path(tempfile.mkdtemp(prefix=f"hybridkv-programs-{family}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # cached for the session, removed at its end
    if family == "gguf_q8_0":  # llama.cpp's converter's file; transformers on its dequantized weights
        gguf = Path(__file__).parent / "data" / "gguf" / "qwen35moe-tiny-q8_0.gguf"
        checkpoint = GGUFCheckpoint(GGUFTensors(gguf))
        save_file({n: checkpoint.read(n).contiguous() for n in checkpoint.names}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(checkpoint.hf_config))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        return hf, gguf, qwen35_logits
    if family == "qwen3_next":
        model = make_hf_model(seed=11, full_attention_interval=2)
        return model, save_checkpoint(model, path), hf_logits
    if family == "qwen3_next_mtp":
        model, _, _ = reference("qwen3_next")
        return model, add_mtp(save_checkpoint(model, path), mtp_reference()), hf_logits
    # released style: vision-language wrapper, visual and mtp tensors, 2 shards; Hv = 3·Hk, dk != dv
    odd = dict(linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=3)
    model = make_qwen35(moe=family == "qwen3_5_moe", seed=11, full_attention_interval=2, **odd)
    return model, save_qwen35(model, path, shards=2), qwen35_logits


@functools.cache
def mtp_reference() -> dict[str, torch.Tensor]:
    """The `mtp.*` tensors of the qwen3_next_mtp family (the twin computes from them)."""
    hf, _, _ = reference("qwen3_next")
    return mtp_tensors(hf.config, seed=12, moe=True)


class CachePrograms(RuleBasedStateMachine):
    family = "qwen3_next"
    mtp = False
    kv_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        super().__init__()
        self.hf, checkpoint, self.logits_fn = reference(self.family)
        config = CacheConfig(
            snapshot_interval=5,
            snapshots_per_sequence=3,
            max_model_len=MAX_LEN,
            block_size=4,
            max_sequences=4,
            verify_rows=6,
            kv_dtype=self.kv_dtype,
        )
        self.cm = CachedModel.load(checkpoint, cache=config, mtp=self.mtp)
        self.expected: dict[int, list[int]] = {}

    def check(self, seq: int, rows: torch.Tensor) -> None:
        want = self.logits_fn(self.hf, self.expected[seq])[-len(rows) :]
        assert max_rel_err(rows, want) <= 1e-4

    def changed(self, seq: int, data: st.DataObject) -> None:
        """Called after an operation changed `seq`: variants check more here."""

    @precondition(lambda self: len(self.expected) < 4)
    @rule()
    def new_sequence(self) -> None:
        self.expected[self.cm.new_sequence()] = []

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 12), both=st.booleans())
    def feed(self, data: st.DataObject, n: int, both: bool) -> None:
        seqs = sorted(self.expected)
        chosen = data.draw(st.sampled_from(seqs))
        batch = {chosen: data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))}
        if both and len(seqs) > 1:
            other = data.draw(st.sampled_from([s for s in seqs if s != chosen]))
            batch[other] = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
        if any(len(self.expected[s]) + len(ids) > MAX_LEN for s, ids in batch.items()):
            return
        try:
            out = self.cm.feed(batch)
        except CacheFull:
            return
        for seq, ids in batch.items():
            self.expected[seq] += ids
            self.check(seq, out[seq])
            self.changed(seq, data)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(2, 4), keep=st.integers(1, 4))
    def verify(self, data: st.DataObject, n: int, keep: int) -> None:
        """Speculative verification: feed a token and n-1 drafts, keep the first `keep` (the
        others rejected): the kept rows' logits and everything after equal a recompute over
        the kept tokens only."""
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        if len(self.expected[seq]) + n > MAX_LEN:
            return
        keep = min(keep, n)
        try:
            out = self.cm.feed({seq: ids}, verify=[seq])
        except CacheFull:
            return
        self.cm.accept(seq, len(self.expected[seq]) + keep)
        self.expected[seq] += ids[:keep]
        self.check(seq, out[seq][:keep])
        self.changed(seq, data)

    @precondition(lambda self: self.expected and len(self.expected) < 4)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.expected)))
        length = data.draw(st.integers(0, len(self.expected[src])))
        try:
            child = self.cm.fork(src, length=length)
        except CacheFull:
            return
        self.expected[child] = self.expected[src][:length]
        self.changed(child, data)
        self.changed(src, data)  # its shared blocks and slot are untouched

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        p = data.draw(st.integers(0, len(self.expected[seq])))
        resumable = self.cm.can_resume(seq, p)
        before = self.cm.stats()["tokens_recomputed"]
        try:
            keep = self.cm.truncate(seq, p)
        except CacheFull:
            return
        assert keep <= p
        assert resumable == (keep == p)
        assert self.cm.stats()["tokens_recomputed"] - before == p - keep
        self.expected[seq] = self.expected[seq][:p]
        self.changed(seq, data)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), where=st.integers(0, 2))
    def bad_feed(self, data: st.DataObject, where: int) -> None:
        """A batch with one bad part (token outside the vocabulary, unknown sequence, no tokens) is
        refused as a whole; the invariant below proves nothing changed."""
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        batch: dict[int, list[int]] = {seq: [1, 2]}
        if where == 0:
            batch[seq] = [3, self.cm.vocab_size]
        elif where == 1:
            batch[max(self.expected) + 100] = [1]
        else:
            batch[seq] = []
        with pytest.raises(ValueError):
            self.cm.feed(batch)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.cm.release(seq)
        del self.expected[seq]

    @invariant()
    def bookkeeping_is_whole(self) -> None:
        self.cm.cache.check_integrity()
        for seq, ids in self.expected.items():
            assert self.cm.tokens(seq) == ids


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=14,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class MTPPrograms(CachePrograms):
    """With the MTP block loaded: after every change (a fork at a length is a prefix reuse from a
    snapshot) the sequence's MTP drafts equal a fresh no-cache twin's over the same tokens, so
    its MTP K/V and hidden carry are right wherever they came from."""

    family = "qwen3_next_mtp"
    mtp = True

    def changed(self, seq: int, data: st.DataObject) -> None:
        ids = self.expected[seq]
        if ids:
            pending = data.draw(st.integers(0, VOCAB - 1))
            got = self.cm.draft_mtp_logits({seq: pending}, 2)[seq]
            assert max_rel_err(got, twin_draft(mtp_reference(), self.hf, True, ids, pending, 2)) <= 1e-4


class HalfKVPrograms(CachePrograms):
    """K/V stored in float16 (`CacheConfig.kv_dtype`), whichever way the tokens came (chunks,
    decode steps, verifies, forks, truncations): every logit equals transformers' with its
    attention reading the K/V the cache holds for the sequence, and those are transformers' own
    rounded to float16 (`attention_reads`). Reading its own unrounded K/V instead, transformers'
    logits differ by ~1e-3, ten times the tolerance."""

    kv_dtype = torch.float16

    def check(self, seq: int, rows: torch.Tensor) -> None:
        ids, cache = self.expected[seq], self.cm.cache
        bs, table = cache.config.block_size, cache.block_table(seq)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(ids))])
        pools = zip(cache.tensors.key, cache.tensors.value, strict=True)
        stored = [tuple(pool.flatten(0, 1)[slots].float() for pool in kv) for kv in pools]
        assert all(pool.dtype == self.kv_dtype for pool in cache.tensors.key + cache.tensors.value)
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        with attention_reads(stored, seen):
            want = self.logits_fn(self.hf, ids)[-len(rows) :]
        assert max_rel_err(rows, want) <= 1e-4
        # Rounded to nearest: half a step of the type (at most eps/2 relative), or one and a half
        # where a float32 difference crossed a rounding boundary; the float32 differences
        # themselves (up to the logits' 1e-4 after the layers before) are relative to the largest.
        step = torch.finfo(self.kv_dtype).eps
        for ours, theirs in zip(stored, seen, strict=True):
            for got, ref in zip(ours, theirs, strict=True):
                excess = (got - ref).abs() - 2 * step * ref.abs() - 1e-5 * ref.abs().max()
                assert excess.max() <= 0, (excess.max().item(), got.flatten()[excess.argmax()], ref)


class BFloat16KVPrograms(HalfKVPrograms):
    kv_dtype = torch.bfloat16


class Qwen35DensePrograms(CachePrograms):
    family = "qwen3_5"


class Qwen35MoePrograms(CachePrograms):
    family = "qwen3_5_moe"


class GGUFPrograms(CachePrograms):
    """The file's blocks multiplied in float32 throughout (`float_activations`): the cache is exact
    against transformers; the 8-bit activation products are tests/models/test_gguf_blocks.py's."""

    family = "gguf_q8_0"

    def __init__(self) -> None:
        self._float = contextlib.ExitStack()
        self._float.enter_context(float_activations())
        super().__init__()

    def teardown(self) -> None:
        self._float.close()


CachePrograms.TestCase.settings = _settings(30)
TestCachePrograms = CachePrograms.TestCase
# Qwen3.5: a short run by default, the long one under -m slow.
Qwen35DensePrograms.TestCase.settings = _settings(8)
Qwen35MoePrograms.TestCase.settings = _settings(8)
TestQwen35DensePrograms = Qwen35DensePrograms.TestCase
TestQwen35MoePrograms = Qwen35MoePrograms.TestCase
GGUFPrograms.TestCase.settings = _settings(6)
HalfKVPrograms.TestCase.settings = _settings(20)
TestHalfKVPrograms = HalfKVPrograms.TestCase
BFloat16KVPrograms.TestCase.settings = _settings(10)
TestBFloat16KVPrograms = BFloat16KVPrograms.TestCase
MTPPrograms.TestCase.settings = _settings(5)
TestMTPPrograms = MTPPrograms.TestCase
TestGGUFPrograms = GGUFPrograms.TestCase


class Qwen35DenseProgramsLong(Qwen35DensePrograms):
    pass


class Qwen35MoeProgramsLong(Qwen35MoePrograms):
    pass


Qwen35DenseProgramsLong.TestCase.settings = _settings(60)
Qwen35MoeProgramsLong.TestCase.settings = _settings(60)
TestQwen35DenseProgramsLong = pytest.mark.slow(Qwen35DenseProgramsLong.TestCase)
TestQwen35MoeProgramsLong = pytest.mark.slow(Qwen35MoeProgramsLong.TestCase)
