"""Random programs of cache operations: every logit equals a fresh transformers recompute and
the bookkeeping stays whole after every step."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
from hf_reference import hf_logits, make_hf_model, max_rel_err, save_checkpoint
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv import CacheConfig, CachedModel, CacheFull

MAX_LEN = 48
VOCAB = 128


@functools.cache
def reference() -> tuple[Any, Path]:
    model = make_hf_model(seed=11, full_attention_interval=2)
    path = Path(tempfile.mkdtemp(prefix="hybridkv-programs-"))
    return model, save_checkpoint(model, path)


class CachePrograms(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.hf, checkpoint = reference()
        config = CacheConfig(
            snapshot_interval=5,
            snapshots_per_sequence=3,
            max_model_len=MAX_LEN,
            block_size=4,
            max_sequences=4,
        )
        self.cm = CachedModel.load(checkpoint, cache=config)
        self.expected: dict[int, list[int]] = {}

    def check(self, seq: int, rows: torch.Tensor) -> None:
        want = hf_logits(self.hf, self.expected[seq])[-len(rows) :]
        assert max_rel_err(rows, want) <= 1e-4

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


CachePrograms.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCachePrograms = CachePrograms.TestCase
