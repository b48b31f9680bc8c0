"""Snapshots of the recurrent state: a shared budgeted pool, and one small ring per sequence.

A snapshot at position p is every linear layer's conv and delta state *after* token p. Rings hold
references into the pool; a snapshot is freed when no ring holds it. A full pool evicts the complete
snapshot that saves the least recomputation (dropping it from every ring) and never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.cache.refpool import RefPool
from hybridkv.errors import IntegrityError


@dataclass(slots=True)
class _Entry:
    position: int
    complete: bool = False
    last_used: int = 0
    holders: list[SnapshotRing] = field(default_factory=list)


class SnapshotPool:
    """Bookkeeping of `capacity` snapshot rows (the tensors live in `CacheTensors.snap_*`)."""

    def __init__(self, capacity: int) -> None:
        self.ids = RefPool("snapshot", capacity)
        self._entries: dict[int, _Entry] = {}
        self._clock = 0
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return self.ids.capacity

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def alloc(self, position: int, ring: SnapshotRing) -> int | None:
        """A new incomplete snapshot for `position`, held by `ring`; None when every row is
        pending in the running forward (nothing is evictable)."""
        if self.ids.num_free == 0 and not self._evict_one():
            return None
        snap = self.ids.alloc()
        self._entries[snap] = _Entry(position, last_used=self._tick(), holders=[ring])
        return snap

    def _evict_one(self) -> bool:
        """Evict the complete snapshot that saves the least compute per byte (all snapshots have
        the same size, so: the fewest tokens over the next restore point below it in any ring
        holding it), the least recently used among equals."""
        victims = [(self._tokens_saved(s, e), e.last_used, s) for s, e in self._entries.items() if e.complete]
        if not victims:
            return False
        *_, snap = min(victims)
        for ring in list(self._entries[snap].holders):
            ring._forget(snap)
        self.evictions += 1
        return True

    def _tokens_saved(self, snap: int, entry: _Entry) -> int:
        saved = 0
        for ring in entry.holders:
            below = [pos for pos, other in ring.entries if pos < entry.position and self._entries[other].complete]
            saved = max(saved, entry.position - max(below, default=-1))
        return saved

    def hold(self, snap: int, ring: SnapshotRing) -> None:
        self.ids.incref(snap)
        self._entries[snap].holders.append(ring)

    def unhold(self, snap: int, ring: SnapshotRing) -> None:
        self._entries[snap].holders.remove(ring)
        if self.ids.decref(snap):
            del self._entries[snap]

    def mark_complete(self, snaps: list[int]) -> None:
        for snap in snaps:
            if snap in self._entries:
                self._entries[snap].complete = True

    def drop_pending(self, snaps: list[int]) -> None:
        """Forget snapshots whose forward never ran (it raised)."""
        for snap in snaps:
            entry = self._entries.get(snap)
            if entry is not None and not entry.complete:
                for ring in list(entry.holders):
                    ring._forget(snap)

    def position(self, snap: int) -> int:
        return self._entries[snap].position

    def is_complete(self, snap: int) -> bool:
        return self._entries[snap].complete

    def touch(self, snap: int) -> None:
        self._entries[snap].last_used = self._tick()

    def check_integrity(self, rings: list[SnapshotRing]) -> None:
        expected: dict[int, int] = {}
        for ring in rings:
            for pos, snap in ring.entries:
                expected[snap] = expected.get(snap, 0) + 1
                entry = self._entries.get(snap)
                if entry is None:
                    raise IntegrityError(f"a ring points at freed snapshot {snap}")
                if entry.position != pos:
                    raise IntegrityError(f"snapshot {snap} is at {entry.position}, a ring says {pos}")
                if ring not in entry.holders:
                    raise IntegrityError(f"snapshot {snap} does not list a ring that holds it")
        for snap, entry in self._entries.items():
            if len(entry.holders) != expected.get(snap, 0):
                raise IntegrityError(f"snapshot {snap} lists {len(entry.holders)} holders")
        self.ids.check(expected)


class SnapshotRing:
    """One sequence's snapshots: at most `capacity`, oldest overwritten first (FIFO).

    `best(p)` is the complete entry with the highest position < p: restoring it keeps p' = pos + 1
    tokens. `last_pos` is the newest recorded position (-1 when empty after a prune).
    """

    def __init__(self, pool: SnapshotPool, capacity: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self.entries: list[tuple[int, int]] = []  # (position, snapshot id), oldest first
        self.last_pos = -1

    def record(self, position: int) -> int | None:
        """Take a new snapshot row for `position`; returns its id (to be filled), or None."""
        if self.capacity == 0:
            return None
        snap = self.pool.alloc(position, self)
        if snap is None:
            return None
        self._drop_where(lambda pos: pos == position)
        if len(self.entries) >= self.capacity:
            self._drop_index(0)
        self.entries.append((position, snap))
        self.last_pos = position
        return snap

    def adopt(self, position: int, snap: int) -> None:
        """Share another ring's snapshot (a fork): one more reference, no copy."""
        if self.capacity == 0:
            return
        if len(self.entries) >= self.capacity:
            self._drop_index(0)
        self.pool.hold(snap, self)
        self.entries.append((position, snap))
        self.last_pos = max(self.last_pos, position)

    def best(self, target: int) -> tuple[int, int] | None:
        """(position, id) of the complete entry with the highest position < target, or None."""
        found: tuple[int, int] | None = None
        for pos, snap in self.entries:
            if pos < target and self.pool.is_complete(snap) and (found is None or pos > found[0]):
                found = (pos, snap)
        if found is not None:
            self.pool.touch(found[1])
        return found

    def prune_after(self, position: int) -> None:
        """Drop entries after `position`; `last_pos` becomes `position`, or -1 if nothing is left."""
        self._drop_where(lambda pos: pos > position)
        self.last_pos = position if self.entries else -1

    def reset(self) -> None:
        self._drop_where(lambda pos: True)
        self.last_pos = -1

    def _drop_where(self, predicate: Callable[[int], bool]) -> None:
        for i in range(len(self.entries) - 1, -1, -1):
            if predicate(self.entries[i][0]):
                self._drop_index(i)

    def _drop_index(self, i: int) -> None:
        _, snap = self.entries.pop(i)
        self.pool.unhold(snap, self)

    def _forget(self, snap: int) -> None:
        """Called by the pool when it evicts `snap`."""
        for i, (_, held) in enumerate(self.entries):
            if held == snap:
                self._drop_index(i)
                return
