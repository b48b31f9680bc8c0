"""A fixed set of ids with a free list and reference counts: KV blocks, state slots, snapshots."""

from __future__ import annotations

from hybridkv.errors import CacheFull, IntegrityError


class RefPool:
    """Ids 0..capacity-1. `alloc` hands out the lowest never-used id first, then reuses freed ids
    last-freed-first; an id is free exactly when its refcount is 0."""

    __slots__ = ("name", "capacity", "_free", "_refs")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._refs = [0] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, ident: int) -> int:
        return self._refs[ident]

    def alloc(self) -> int:
        if not self._free:
            raise CacheFull(f"no free {self.name} (all {self.capacity} in use)")
        ident = self._free.pop()
        self._refs[ident] = 1
        return ident

    def incref(self, ident: int) -> None:
        if self._refs[ident] <= 0:
            raise IntegrityError(f"{self.name} {ident} is free and cannot gain a reference")
        self._refs[ident] += 1

    def decref(self, ident: int) -> bool:
        """Drop one reference; returns True when that freed the id."""
        if self._refs[ident] <= 0:
            raise IntegrityError(f"{self.name} {ident} is already free")
        self._refs[ident] -= 1
        if self._refs[ident] == 0:
            self._free.append(ident)
            return True
        return False

    def check(self, expected_refs: dict[int, int]) -> None:
        """Raise IntegrityError unless refcounts equal `expected_refs` (id -> references held)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError(f"{self.name}: an id is on the free list twice")
        for ident in range(self.capacity):
            want = expected_refs.get(ident, 0)
            if self._refs[ident] != want:
                raise IntegrityError(f"{self.name} {ident}: refcount {self._refs[ident]} but {want} references exist")
            if (want == 0) != (ident in free):
                raise IntegrityError(f"{self.name} {ident}: free list disagrees with refcount {want}")
        if len(free) + sum(1 for r in self._refs if r > 0) != self.capacity:
            raise IntegrityError(f"{self.name}: free + used != total")
