"""CachedModel: every cache operation gives the logits of a fresh transformers recompute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_logits, make_hf_model, max_rel_err, save_checkpoint

from hybridkv import CacheConfig, CachedModel, CacheFull
from hybridkv.cache.config import PoolSizes
from hybridkv.cached_model import cache_spec
from hybridkv.models import read_checkpoint, weights_nbytes
from hybridkv.models.weights import InsufficientMemory, MemoryShare, cache_room

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return make_hf_model(seed=3)


@pytest.fixture(scope="module")
def checkpoint(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("ckpt"))


def load(checkpoint: Path, **cache: Any) -> CachedModel:
    settings: dict[str, Any] = dict(snapshot_interval=8, max_model_len=96, block_size=4, max_sequences=8)
    settings.update(cache)
    return CachedModel.load(checkpoint, cache=CacheConfig(**settings))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_exact(hf_model: Any, cm: CachedModel, seq: int, rows: torch.Tensor) -> None:
    """`rows` are the logits of the last len(rows) tokens of `seq`."""
    want = hf_logits(hf_model, cm.tokens(seq))[-len(rows) :]
    assert max_rel_err(rows, want) <= TOL


def test_prefill_decode_and_chunked_prefill_match_transformers(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint)
    ids = tokens(30, 1)
    a, b = cm.new_sequence(), cm.new_sequence()
    out = cm.feed({a: ids[:20], b: ids[:7]})
    assert out[a].shape == (20, 128) and out[a].dtype == torch.float32
    assert_exact(hf_model, cm, a, out[a])
    assert_exact(hf_model, cm, b, out[b])
    for t in ids[20:]:
        assert_exact(hf_model, cm, a, cm.feed({a: [t]}, logits="last")[a])
    for chunk in (ids[7:8], ids[8:19], ids[19:30]):
        rows = cm.feed({b: chunk})[b]
        assert_exact(hf_model, cm, b, rows)
    assert cm.feed({a: [1]}, logits="none") == {}
    cm.cache.check_integrity()


def test_fork_then_diverge_keeps_both_branches_exact(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint)
    parent = cm.new_sequence()
    cm.feed({parent: tokens(13, 2)})
    computed = cm.stats()["tokens_computed"]
    child = cm.fork(parent)
    assert cm.stats()["tokens_computed"] == computed  # O(1): nothing recomputed
    out = cm.feed({child: [5, 6], parent: [7]})
    assert_exact(hf_model, cm, child, out[child])
    assert_exact(hf_model, cm, parent, out[parent])
    assert cm.tokens(parent)[-1] == 7 and cm.tokens(child)[-2:] == [5, 6]
    cm.cache.check_integrity()


def test_fork_at_shorter_length_reuses_snapshot(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint)
    parent = cm.new_sequence()
    cm.feed({parent: tokens(20, 4)})
    child = cm.fork(parent, length=11)
    stats = cm.stats()
    assert stats["tokens_recomputed"] == 3  # snapshot after position 7 covers 8 tokens
    assert stats["snapshot_hits"] == 1
    assert cm.tokens(child) == cm.tokens(parent)[:11]
    assert_exact(hf_model, cm, child, cm.feed({child: [3]})[child])
    empty = cm.fork(parent, length=0)
    assert cm.length(empty) == 0
    assert_exact(hf_model, cm, empty, cm.feed({empty: [9, 9]})[empty])
    cm.cache.check_integrity()


def test_truncate_to_snapshot_recomputes_nothing(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint)
    s = cm.new_sequence()
    cm.feed({s: tokens(21, 5)})
    assert cm.can_resume(s, 16) and not cm.can_resume(s, 12)
    assert cm.truncate(s, 16) == 16
    assert cm.stats()["tokens_recomputed"] == 0
    assert cm.length(s) == 16
    assert_exact(hf_model, cm, s, cm.feed({s: [4, 2]})[s])
    cm.cache.check_integrity()


def test_truncate_between_snapshots_recomputes_only_the_gap(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint)
    s = cm.new_sequence()
    cm.feed({s: tokens(21, 6)})
    assert cm.truncate(s, 13) == 8
    assert cm.stats()["tokens_recomputed"] == 5
    assert cm.length(s) == 13
    assert_exact(hf_model, cm, s, cm.feed({s: [1]})[s])
    assert cm.truncate(s, 14) == 14  # the length itself: nothing to do
    assert cm.truncate(s, 5) == 0  # no snapshot below 5: recompute from the start
    assert cm.stats()["snapshot_misses"] == 1
    assert_exact(hf_model, cm, s, cm.feed({s: [8, 8, 8]})[s])
    cm.cache.check_integrity()


def test_a_replica_sizes_its_default_cache_in_its_share_of_the_memory(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas and a spare (`serve --replicas 2`): each worker's default cache takes its part
    of what three copies of the weights leave, so all of them together fit as one process would."""
    config = CacheConfig(snapshot_interval=4, max_model_len=96, block_size=4, max_sequences=8)
    full = PoolSizes.plan(cache_spec(read_checkpoint(checkpoint)[0], torch.float32), config)
    weights = weights_nbytes(checkpoint, torch.float32)
    available = int((3 * weights + full.total_bytes) / 0.9)  # alone, one worker's default cache would fit
    share = MemoryShare(available, copies=3, caches=2)
    with caplog.at_level("WARNING", logger="hybridkv"):
        cm = CachedModel.load(checkpoint, cache=config, memory=share)
    total = cm.cache.sizes.total_bytes
    assert total <= cache_room(weights, share) < full.total_bytes
    assert 3 * weights + 2 * total <= 0.9 * available
    assert "3 copies of the weights leave, split between 2 replicas" in caplog.text
    alone = CachedModel.load(checkpoint, cache=config, memory=MemoryShare(available))
    assert alone.cache.sizes.total_bytes == full.total_bytes
    with pytest.raises(InsufficientMemory, match="3 copies of the weights"):
        CachedModel.load(checkpoint, cache=config, memory=MemoryShare(int(2.5 * weights), copies=3, caches=2))


def test_released_slots_and_blocks_are_reused_cleanly(hf_model: Any, checkpoint: Path) -> None:
    cm = load(checkpoint, max_sequences=2)
    first = cm.new_sequence()
    cm.feed({first: tokens(17, 7)})
    cm.release(first)
    assert cm.stats()["kv_bytes_used"] == 0 and cm.stats()["snapshot_bytes_used"] == 0
    second = cm.new_sequence()
    out = cm.feed({second: tokens(9, 8)})  # must not see the first sequence's state
    assert_exact(hf_model, cm, second, out[second])
    cm.cache.check_integrity()


def test_a_default_cache_too_big_for_the_machine_is_shrunk_and_stays_exact(
    hf_model: Any, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = CacheConfig(snapshot_interval=4, max_model_len=96, block_size=4, max_sequences=8)
    spec = cache_spec(read_checkpoint(checkpoint)[0], torch.float32)
    full = PoolSizes.plan(spec, config)
    room = full.state_bytes + (full.kv_bytes + full.snapshot_bytes) // 5  # the live slots keep their size
    weights = weights_nbytes(checkpoint, torch.float32)
    monkeypatch.setattr("hybridkv.models.weights.available_memory", lambda: int((2 * room + weights) / 0.9) + 16)
    with caplog.at_level("WARNING", logger="hybridkv"):
        cm = CachedModel.load(checkpoint, cache=config)
    sizes = cm.cache.sizes
    assert cache_room(weights) >= room and 0.8 * room <= sizes.total_bytes <= room
    assert sizes.num_slots == full.num_slots and sizes.num_blocks < full.num_blocks
    assert 0 < sizes.num_snapshots < 2 * config.snapshots_per_sequence  # two sequences' rings overflow it
    assert "sized to" in caplog.text and "--cache-memory sets its size" in caplog.text
    a, b = cm.new_sequence(), cm.new_sequence()  # more snapshots than the pool holds: evictions
    ta, tb = tokens(60, 11), tokens(50, 12)
    for i in range(0, 60, 6):  # a snapshot every 4 tokens, kept by the rings until the pool is full
        out = cm.feed({seq: ids[i : i + 6] for seq, ids in ((a, ta), (b, tb)) if ids[i:]})
    assert_exact(hf_model, cm, a, out[a])
    child = cm.fork(a, length=41)
    assert_exact(hf_model, cm, child, cm.feed({child: [3, 4]})[child])
    cm.truncate(b, 33)
    assert_exact(hf_model, cm, b, cm.feed({b: [7]})[b])
    assert cm.cache.snapshots.evictions > 0
    cm.cache.check_integrity()


def test_bad_input_is_a_value_error_that_changes_nothing(checkpoint: Path) -> None:
    cm = load(checkpoint)
    s = cm.new_sequence()
    cm.feed({s: [1, 2, 3]})
    for bad in ({s: []}, {s: [1, 128]}, {s: [-1]}, {12345: [1]}, {s: ["a"]}, {}):
        with pytest.raises(ValueError):
            cm.feed(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cm.feed({s: [1]}, logits="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"feed takes \{sequence: \[token ids\]\}, got int"):
        cm.feed(s, [4])  # type: ignore[arg-type]
    for p in (-1, 4):
        with pytest.raises(ValueError):
            cm.truncate(s, p)
        with pytest.raises(ValueError):
            cm.fork(s, length=p)
    with pytest.raises(ValueError, match="max_model_len"):
        cm.feed({s: [1] * 94})
    assert cm.tokens(s) == [1, 2, 3]
    cm.cache.check_integrity()


def test_cache_full_raises_and_leaves_sequences_usable(hf_model: Any, checkpoint: Path) -> None:
    spec_bytes = CachedModel.load(checkpoint, cache=CacheConfig(max_model_len=16, block_size=4)).cache.spec
    cm = load(checkpoint, max_model_len=16, kv_bytes=6 * 4 * spec_bytes.kv_bytes_per_token)
    a, b = cm.new_sequence(), cm.new_sequence()
    cm.feed({a: tokens(14, 9)})
    with pytest.raises(CacheFull):
        cm.feed({b: tokens(9, 10)})
    assert cm.length(b) == 0
    cm.cache.check_integrity()
    assert_exact(hf_model, cm, a, cm.feed({a: [2]})[a])
    assert_exact(hf_model, cm, b, cm.feed({b: [3, 4]})[b])


def test_bfloat16_compute_stays_as_close_as_transformers_own_bfloat16(hf_model: Any, checkpoint: Path) -> None:
    cm = CachedModel.load(checkpoint, dtype=torch.bfloat16, cache=CacheConfig(max_model_len=64))
    s = cm.new_sequence()
    ids = tokens(24, 11)
    out = cm.feed({s: ids})[s]
    assert out.dtype == torch.float32
    assert cm.cache.tensors.delta[0].dtype == torch.float32
    want = hf_logits(hf_model, ids)
    hf_bf16 = hf_logits(make_hf_model(seed=3).to(torch.bfloat16), ids)
    # bf16 rounding (8-bit mantissa) can flip an expert choice, so a single row may move a lot;
    # the bound: rows typically within 3e-2 of float32, and no worse than 3x transformers' own bf16.
    ours = (out - want).abs().amax(1) / want.abs().max()
    theirs = (hf_bf16 - want).abs().amax(1) / want.abs().max()
    assert ours.median() <= 3e-2
    assert ours.max() <= 3 * theirs.max()
