"""Bookkeeping of the hybrid cache with exact ids (no model): blocks, slots, snapshots, errors."""

from __future__ import annotations

import pytest
import torch

from hybridkv.cache.config import CacheConfig, CacheSpec, PoolSizes, fit_pools
from hybridkv.cache.hybrid import HybridCache
from hybridkv.errors import CacheFull, IntegrityError

SPEC = CacheSpec(
    num_attention_layers=1,
    num_kv_heads=1,
    head_dim=2,
    kv_dtype=torch.float32,
    num_linear_layers=1,
    conv_channels=3,
    conv_kernel=3,
    num_value_heads=1,
    key_head_dim=2,
    value_head_dim=2,
)


def make(**overrides: int) -> HybridCache:
    settings = dict(max_sequences=4, max_model_len=16, block_size=4, snapshot_interval=4, snapshots_per_sequence=4)
    settings.update(overrides)
    return HybridCache(SPEC, CacheConfig(**settings))  # type: ignore[arg-type]


def run(cache: HybridCache, batch: dict[int, int], fill: float = 1.0) -> None:
    """Stand in for the model: write recognisable values into every row the forward owns."""
    fb = cache.begin_forward(batch)
    cache.tensors.key[0].view(-1, 1, 2)[fb.slot_mapping] = fill
    for j in range(SPEC.num_linear_layers):
        cache.tensors.delta[j][fb.state_slots] += fill
        cache.tensors.snap_delta[j][fb.snapshot_ids] = fb.snapshot_at.to(torch.float32).view(-1, 1, 1, 1)
    cache.end_forward(fb)
    cache.check_integrity()


def test_budget_that_cannot_hold_one_sequence_is_refused_up_front() -> None:
    per_block = SPEC.kv_bytes_per_token * 4
    with pytest.raises(ValueError, match="kv_bytes"):
        PoolSizes.plan(SPEC, CacheConfig(kv_bytes=3 * per_block, max_model_len=16, block_size=4))
    with pytest.raises(ValueError, match="state_bytes"):
        PoolSizes.plan(SPEC, CacheConfig(state_bytes=1))
    sizes = PoolSizes.plan(SPEC, CacheConfig(kv_bytes=4 * per_block, max_model_len=16, block_size=4))
    assert sizes.num_blocks == 4


def test_default_sized_pools_shrink_together_to_fit_the_room() -> None:
    config = CacheConfig(max_sequences=4, max_model_len=16, block_size=4, snapshots_per_sequence=4)
    full = PoolSizes.plan(SPEC, config)  # KV 16 blocks of 64 B, 4 slots and 16 snapshots of 40 B
    assert (full.kv_bytes, full.state_bytes, full.snapshot_bytes) == (1024, 160, 640)
    assert fit_pools(SPEC, config, full.total_bytes) == (config, 1.0)  # fits: untouched
    fitted, factor = fit_pools(SPEC, config, 1000)
    sizes = PoolSizes.plan(SPEC, fitted)
    assert factor == pytest.approx((1000 - 160) / (1024 + 640))
    assert sizes.total_bytes <= 1000 and sizes.num_slots == 4  # the live slots keep their size
    assert (sizes.num_blocks, sizes.num_snapshots) == (8, 8)  # both about halved, whole blocks
    assert (fitted.max_sequences, fitted.max_model_len) == (4, 16)
    tiny, _ = fit_pools(SPEC, config, 100)  # not even one sequence fits: the least plan, over the room
    least = PoolSizes.plan(SPEC, tiny)
    assert (least.num_blocks, least.num_snapshots) == (4, 0) and least.total_bytes > 100
    explicit = CacheConfig(max_sequences=4, max_model_len=16, block_size=4, snapshots_per_sequence=4, kv_bytes=1024)
    kept, _ = fit_pools(SPEC, explicit, 1000)  # a budget given is never changed: only snapshots shrink
    assert kept.kv_bytes == 1024 and PoolSizes.plan(SPEC, kept).num_snapshots == 0
    given = CacheConfig(kv_bytes=1024, snapshot_bytes=640, max_model_len=16, block_size=4)
    assert fit_pools(SPEC, given, 10) == (given, 1.0)


def test_blocks_and_slots_are_allocated_as_tokens_arrive() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 5})
    assert cache._seqs[s].block_table == [0, 1]
    assert cache._seqs[s].slot == 0
    assert cache.length(s) == 5
    fb = cache.begin_forward({s: 3})
    assert fb.positions.tolist() == [5, 6, 7]
    assert fb.slot_mapping.tolist() == [5, 6, 7]
    assert fb.block_tables.tolist() == [[0, 1]]
    assert fb.snapshot_at.tolist() == [2]  # position 7: length reaches 8, a multiple of 4
    cache.end_forward(fb)


def test_interval_snapshots_land_after_positions_interval_minus_one() -> None:
    cache = make()
    s = cache.add_sequence()
    fb = cache.begin_forward({s: 9})
    assert fb.snapshot_at.tolist() == [3, 7]
    cache.end_forward(fb)
    assert cache.snapshot_positions(s) == [3, 7]
    assert cache.can_resume(s, 8) and cache.can_resume(s, 4) and cache.can_resume(s, 9)
    assert not cache.can_resume(s, 6)


def test_fork_shares_blocks_and_slot_then_copies_on_write() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 6}, fill=1.0)
    child, keep = cache.fork(s)
    assert keep == 6
    assert cache._seqs[child].block_table == [0, 1]
    assert cache.blocks.refcount(1) == 2 and cache.slots.refcount(0) == 2
    run(cache, {child: 1}, fill=2.0)
    # the shared partial block and the shared slot were copied before the write
    assert cache._seqs[child].block_table == [0, 2]
    assert cache._seqs[s].block_table == [0, 1]
    assert [cache.slots.refcount(i) for i in (0, 1)] == [1, 1]
    assert cache.tensors.key[0][1, 2].tolist() == [[0.0, 0.0]]  # parent's row 6 untouched
    assert cache.tensors.key[0][2, 2].tolist() == [[2.0, 2.0]]
    assert cache.tensors.delta[0][0].max().item() == 1.0
    assert cache.tensors.delta[0][1].max().item() == 3.0


def test_truncate_restores_snapshot_and_reports_keep() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 10})
    assert cache.snapshot_positions(s) == [3, 7]
    assert cache.truncate(s, 10) == 10  # the length: nothing changes
    keep = cache.truncate(s, 6)
    assert keep == 4
    assert cache.length(s) == 4
    assert cache._seqs[s].block_table == [0]
    assert cache.snapshot_positions(s) == [3]
    # the live slot now holds snapshot 3's contents (the fake model wrote the flat index there)
    assert cache.tensors.delta[0][cache._seqs[s].slot].max().item() == 3.0
    cache.check_integrity()
    assert cache.truncate(s, 0) == 0
    assert cache._seqs[s].slot is None and cache._seqs[s].block_table == []
    cache.check_integrity()


def test_restore_of_shared_slot_gives_each_sequence_its_own_slot() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 6})
    child, _ = cache.fork(s)
    assert cache.slots.refcount(0) == 2
    assert cache.truncate(child, 5) == 4
    assert [cache.slots.refcount(i) for i in (0, 1)] == [1, 1]
    cache.check_integrity()


def test_fork_below_length_shares_snapshots_by_refcount() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 10})
    child, keep = cache.fork(s, 9)
    assert keep == 8
    assert cache.snapshot_positions(child) == [3, 7]
    snap = dict(cache._seqs[s].ring.entries)
    assert cache.snapshots.ids.refcount(snap[7]) == 2
    assert cache._seqs[child].block_table == [0, 1]
    cache.check_integrity()


def test_cache_full_leaves_everything_unchanged() -> None:
    cache = make(max_sequences=2, max_model_len=8, kv_bytes=SPEC.kv_bytes_per_token * 4 * 3)
    a, b = cache.add_sequence(), cache.add_sequence()
    run(cache, {a: 8})
    before = (cache.blocks.num_free, cache.slots.num_free, cache.length(b))
    with pytest.raises(CacheFull):
        cache.begin_forward({b: 5})
    assert (cache.blocks.num_free, cache.slots.num_free, cache.length(b)) == before
    cache.check_integrity()
    run(cache, {b: 4})  # what fits still works
    with pytest.raises(CacheFull):
        cache.add_sequence()


def test_bad_requests_are_value_errors_that_change_nothing() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 3})
    with pytest.raises(ValueError, match="max_model_len"):
        cache.begin_forward({s: 14})
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.begin_forward({99: 1})
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(s, 4)
    with pytest.raises(ValueError, match="outside"):
        cache.fork(s, -1)
    assert cache.length(s) == 3
    cache.check_integrity()


def test_release_frees_everything_not_shared() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 9})
    child, _ = cache.fork(s)
    cache.release(s)
    cache.check_integrity()
    assert cache.blocks.num_used == 3 and cache.slots.num_used == 1
    cache.release(child)
    cache.check_integrity()
    assert cache.blocks.num_used == cache.slots.num_used == cache.snapshots.ids.num_used == 0


def test_abort_forward_undoes_lengths_and_pending_snapshots() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 2})
    fb = cache.begin_forward({s: 6})
    cache.abort_forward(fb)
    assert cache.length(s) == 2 and cache.snapshot_positions(s) == []
    cache.check_integrity()
    with pytest.raises(ValueError, match="truncate"):
        cache.begin_forward({s: 1})
    assert cache.truncate(s, 2) == 0  # no snapshot below 2: recompute from scratch
    run(cache, {s: 2})


def test_integrity_check_catches_a_leaked_reference() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 4})
    cache.blocks.incref(0)
    with pytest.raises(IntegrityError):
        cache.check_integrity()


def test_nested_forward_is_refused() -> None:
    cache = make()
    s = cache.add_sequence()
    fb = cache.begin_forward({s: 1})
    with pytest.raises(RuntimeError, match="in progress"):
        cache.begin_forward({s: 1})
    cache.end_forward(fb)


def test_fork_of_length_zero_is_an_empty_sequence_with_no_state() -> None:
    cache = make()
    s = cache.add_sequence()
    run(cache, {s: 6})
    child, keep = cache.fork(s, 0)
    assert keep == 0 and cache.length(child) == 0
    assert cache._seqs[child].slot is None and cache._seqs[child].block_table == []
    assert cache.slots.refcount(0) == 1
    cache.check_integrity()
