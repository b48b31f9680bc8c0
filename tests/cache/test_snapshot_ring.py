"""The seed's checkpoint-ring behaviours (../shared/reference/seed-behaviours.md), ported."""

from __future__ import annotations

from hybridkv.cache.snapshots import SnapshotPool, SnapshotRing


def ring_with(capacity: int, *positions: int, pool_size: int = 16) -> SnapshotRing:
    pool = SnapshotPool(pool_size)
    ring = SnapshotRing(pool, capacity)
    for pos in positions:
        snap = ring.record(pos)
        if snap is not None:
            pool.mark_complete([snap])
    return ring


def best_pos(ring: SnapshotRing, target: int) -> int | None:
    found = ring.best(target)
    return None if found is None else found[0]


def test_best_is_highest_position_strictly_below_target_and_fifo_overwrites() -> None:
    ring = ring_with(2, 10, 20)
    assert best_pos(ring, 15) == 10
    assert best_pos(ring, 20) == 10  # strictly less
    snap = ring.record(30)
    assert snap is not None
    ring.pool.mark_complete([snap])
    assert best_pos(ring, 15) is None  # 10 was overwritten
    assert best_pos(ring, 40) == 30


def test_prepare_restore_keeps_one_past_the_snapshot() -> None:
    ring = ring_with(4, 5, 9, 15)
    found = ring.best(12)
    assert found is not None and found[0] + 1 == 10


def test_prune_after_drops_later_entries() -> None:
    ring = ring_with(4, 10, 20, 30)
    ring.prune_after(20)
    assert best_pos(ring, 35) == 20
    assert ring.last_pos == 20


def test_prune_everything_empties_ring() -> None:
    ring = ring_with(4, 10, 20, 30)
    ring.prune_after(5)
    assert ring.entries == []
    assert ring.last_pos == -1
    assert ring.pool.ids.num_used == 0


def test_ring_of_size_zero_records_nothing() -> None:
    ring = ring_with(0, 10, 20)
    assert ring.entries == []
    assert best_pos(ring, 100) is None
    assert ring.pool.ids.num_used == 0


def test_incomplete_entry_is_never_restored() -> None:
    pool = SnapshotPool(4)
    ring = SnapshotRing(pool, 4)
    done = ring.record(10)
    assert done is not None
    pool.mark_complete([done])
    ring.record(20)  # its forward never finished
    assert best_pos(ring, 25) == 10


def test_reset_frees_every_entry() -> None:
    ring = ring_with(4, 1, 2, 3)
    ring.reset()
    assert ring.entries == [] and ring.pool.ids.num_used == 0
    ring.pool.check_integrity([ring])


def record(ring: SnapshotRing, pos: int) -> None:
    snap = ring.record(pos)
    assert snap is not None
    ring.pool.mark_complete([snap])


def test_full_pool_evicts_the_snapshot_saving_least_recompute() -> None:
    pool = SnapshotPool(3)
    a, b = SnapshotRing(pool, 4), SnapshotRing(pool, 4)
    record(a, 100)
    record(a, 102)  # saves only 2 tokens over a's snapshot at 100
    record(b, 50)  # saves 51 tokens over a fresh start
    record(b, 60)  # pool full: evicts a@102
    assert [p for p, _ in a.entries] == [100]
    assert [p for p, _ in b.entries] == [50, 60]
    assert pool.evictions == 1
    pool.check_integrity([a, b])


def test_among_equal_savings_the_least_recently_used_goes() -> None:
    pool = SnapshotPool(2)
    a, b = SnapshotRing(pool, 4), SnapshotRing(pool, 4)
    record(a, 10)
    record(b, 10)
    a.best(11)  # touch a's snapshot: b's is now the least recently used
    record(a, 21)
    assert [p for p, _ in a.entries] == [10, 21]
    assert b.entries == []
    pool.check_integrity([a, b])


def test_pending_snapshots_are_not_evicted() -> None:
    pool = SnapshotPool(1)
    ring = SnapshotRing(pool, 4)
    assert ring.record(10) is not None  # pending
    assert ring.record(20) is None  # nothing evictable: skipped, not an error
    pool.check_integrity([ring])


def test_shared_snapshot_lives_until_last_holder_drops_it() -> None:
    pool = SnapshotPool(4)
    parent, child = SnapshotRing(pool, 4), SnapshotRing(pool, 4)
    snap = parent.record(7)
    assert snap is not None
    pool.mark_complete([snap])
    child.adopt(7, snap)
    assert pool.ids.refcount(snap) == 2
    parent.reset()
    assert best_pos(child, 8) == 7
    pool.check_integrity([parent, child])
    child.reset()
    assert pool.ids.num_used == 0
