"""The hybrid cache: paged KV for attention layers, state slots and snapshots for linear layers.

Every public operation checks what it needs first and raises (`CacheFull`, `ValueError`) before
changing anything, so an error never leaves half-changed bookkeeping behind.

Speculative verification: a forward that feeds [last token, d1..dk] for a sequence in its
`verify` set writes the recurrent state after each of its first k positions into scratch rows
(extra rows of the snapshot tensors, outside every ring) as the kernel passes them; `accept`
then keeps the accepted prefix by cutting the KV and loading one row into the live slot. Nothing
is copied before the forward and nothing is recomputed after it; a rejected token's state is
never in a ring, so it can reach no fork, restore or prefix reuse.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.cache.batch import CacheTensors, CacheView, ForwardBatch
from hybridkv.cache.config import CacheConfig, CacheSpec, PoolSizes
from hybridkv.cache.refpool import RefPool
from hybridkv.cache.snapshots import SnapshotPool, SnapshotRing
from hybridkv.errors import CacheFull, IntegrityError
from hybridkv.ops import pages


@dataclass(slots=True)
class _Sequence:
    length: int
    ring: SnapshotRing
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None  # None until the first forward (a zero state needs no slot yet)
    live_valid: bool = True  # False after a forward that raised: the live state is unusable
    verify: _Verify | None = None  # the last forward verified drafts: its scratch rows, until `accept`


@dataclass(slots=True)
class _Verify:
    start: int  # the sequence's length before the verify forward
    rows: list[int]  # verify-row ids: the state after position start + i is in rows[i]


@dataclass(slots=True)
class _Pending:
    batch: ForwardBatch
    snapshots: list[int]


class HybridCache:
    """Bookkeeping plus tensor pools for one model. Not thread-safe: one caller drives it."""

    def __init__(self, spec: CacheSpec, config: CacheConfig, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        self.config = config
        self.sizes = PoolSizes.plan(spec, config)
        self.blocks = RefPool("KV block", self.sizes.num_blocks)
        self.slots = RefPool("state slot", self.sizes.num_slots)
        self.snapshots = SnapshotPool(self.sizes.num_snapshots)
        self.verify_rows = RefPool("verify row", self.sizes.num_verify_rows)
        self.tensors = self._allocate(device)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self._pending: _Pending | None = None
        self._pinned: Counter[int] = Counter()  # block -> pins held (blocks a disk write still reads)

    def _allocate(self, device: str | torch.device) -> CacheTensors:
        s, z = self.spec, self.sizes
        f32 = torch.float32

        def zeros(shape: tuple[int, ...], dtype: torch.dtype, streamed: bool) -> torch.Tensor:
            # A decode step streams the K/V of the whole context and every live recurrent state:
            # on the CPU those pools go on huge pages (`ops.pages.zeros`; through 4 KiB pages a
            # step ran 7% slower at 4,096 tokens of context, Qwen3.5-0.8B shape, Q4_K_M). The
            # snapshot pools, copied a row at a time, stay on plain pages.
            if streamed and torch.device(device).type == "cpu":
                return pages.zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        def kv() -> list[torch.Tensor]:
            shape = (z.num_blocks, self.config.block_size, s.num_kv_heads, s.head_dim)
            return [zeros(shape, s.kv_dtype, True) for _ in range(s.num_attention_layers)]

        def states(rows: int, streamed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            conv = [
                zeros((rows, s.conv_channels, s.conv_kernel - 1), f32, streamed) for _ in range(s.num_linear_layers)
            ]
            delta = [
                zeros((rows, s.num_value_heads, s.key_head_dim, s.value_head_dim), f32, streamed)
                for _ in range(s.num_linear_layers)
            ]
            return conv, delta

        def carry(rows: int) -> list[torch.Tensor]:
            return [zeros((rows, s.hidden_carry_dim), f32, False)] if s.hidden_carry_dim else []

        conv, delta = states(z.num_slots, True)
        snap_rows = z.num_snapshots + z.num_verify_rows  # verify rows last
        snap_conv, snap_delta = states(snap_rows, False)
        return CacheTensors(kv(), kv(), conv, delta, snap_conv, snap_delta, carry(z.num_slots), carry(snap_rows))

    # -- sequences ----------------------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new empty sequence; CacheFull when `max_sequences` are live."""
        if len(self._seqs) >= self.config.max_sequences:
            raise CacheFull(f"{len(self._seqs)} sequences are live (CacheConfig.max_sequences)")
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Sequence(0, SnapshotRing(self.snapshots, self.config.snapshots_per_sequence))
        return seq

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def snapshot_positions(self, seq: int) -> list[int]:
        return sorted(pos for pos, _ in self._get(seq).ring.entries)

    def _get(self, seq: int) -> _Sequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"unknown sequence {seq!r}") from None

    def _check_position(self, seq: int, p: int) -> _Sequence:
        s = self._get(seq)
        if not isinstance(p, int) or not 0 <= p <= s.length:
            raise ValueError(f"position {p!r} is outside 0..{s.length} (the length of sequence {seq})")
        return s

    # -- forward ------------------------------------------------------------------------------

    def begin_forward(
        self,
        batch: Mapping[int, int],
        snapshot_positions: Mapping[int, Iterable[int]] | None = None,
        verify: Iterable[int] = (),
    ) -> ForwardBatch:
        """Reserve room for `batch` (sequence -> new token count) and describe it for the model.

        Snapshots are planned at every multiple of `snapshot_interval` reached and at the requested
        `snapshot_positions` (absolute positions inside the new tokens; others are ignored).
        Sequences in `verify` get no snapshots: the state after each new token but the last goes
        to a verify row instead, held until `accept` (interval snapshots are taken there, from
        the accepted rows). Copy-on-write of shared slots and shared partial blocks happens
        here, before the model runs.
        """
        if self._pending is not None:
            raise RuntimeError("a forward is already in progress: call end_forward first")
        if not batch:
            raise ValueError("empty batch: feed at least one token")
        verifying = set(verify)
        if stray := verifying - set(batch):
            raise ValueError(f"verify names sequence {min(stray)!r}, which is not in the batch")
        bs = self.config.block_size
        need_blocks = need_slots = 0
        if self.spec.has_state:
            need_rows = sum(batch[seq] - 1 for seq in verifying)
            held = sum(len(v.rows) for seq in batch if (v := self._get(seq).verify) is not None)
            if need_rows > self.verify_rows.num_free + held:
                raise CacheFull(
                    f"verify rows full: this batch verifies {need_rows} drafts, {self.verify_rows.num_free} rows free "
                    "(CacheConfig.verify_rows)"
                )
        for seq, n in batch.items():
            s = self._get(seq)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"sequence {seq}: token count must be >= 1, got {n!r}")
            if s.length + n > self.config.max_model_len:
                raise ValueError(
                    f"sequence {seq}: {s.length} + {n} tokens exceed max_model_len={self.config.max_model_len}"
                )
            if not s.live_valid:
                raise ValueError(f"sequence {seq}: its last forward failed; truncate it before feeding")
            need_blocks += math.ceil((s.length + n) / bs) - len(s.block_table)
            if s.length % bs and self.blocks.refcount(s.block_table[-1]) > 1:
                need_blocks += 1
            if self.spec.has_state and (s.slot is None or self.slots.refcount(s.slot) > 1):
                need_slots += 1
        if need_blocks > self.blocks.num_free:
            raise CacheFull(f"KV cache full: this batch needs {need_blocks} blocks, {self.blocks.num_free} free")
        if need_slots > self.slots.num_free:
            raise CacheFull(f"state slots full: this batch needs {need_slots}, {self.slots.num_free} free")

        # Plain Python lists, one tensor each at the end: a decode step of N sequences costs a
        # handful of tensor constructions, not a few per sequence.
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        snapshot_at: list[int] = []
        snapshot_ids: list[int] = []
        seq_ids = tuple(batch)
        q_lens = tuple(batch.values())
        start_lens = tuple(self._seqs[seq].length for seq in seq_ids)
        offset = 0
        for seq, n in batch.items():
            s = self._seqs[seq]
            self._drop_verify(s)  # never accepted: the forward before this one kept all it fed
            self._make_last_block_private(s)
            while len(s.block_table) < math.ceil((s.length + n) / bs):
                s.block_table.append(self.blocks.alloc())
            if self.spec.has_state:
                self._make_slot_private(s)
            first, end = s.length, s.length + n
            positions.extend(range(first, end))
            for b in range(first // bs, (end - 1) // bs + 1):  # the rows this forward writes, block by block
                row0 = s.block_table[b] * bs
                slot_mapping.extend(range(row0 + max(first - b * bs, 0), row0 + min(end - b * bs, bs)))
            tables.append(s.block_table)
            if seq in verifying:
                rows = [self.verify_rows.alloc() for _ in range(n - 1)] if self.spec.has_state else []
                s.verify = _Verify(s.length, rows)
                snapshot_at.extend(range(offset, offset + len(rows)))
                snapshot_ids.extend(self.sizes.num_snapshots + row for row in rows)
            else:
                wanted = set(snapshot_positions.get(seq, ()) if snapshot_positions else ())
                for p in self._plan_snapshots(s, n, wanted):
                    snap = s.ring.record(p)
                    if snap is not None:
                        snapshot_at.append(offset + p - s.length)
                        snapshot_ids.append(snap)
            offset += n
        for seq, n in batch.items():
            self._seqs[seq].length += n

        width = max(len(t) for t in tables)
        int64 = torch.int64
        fb = ForwardBatch(
            seq_ids=seq_ids,
            q_lens=q_lens,
            start_lens=start_lens,
            cu_seqlens=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=int64),
            positions=torch.tensor(positions, dtype=int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=int64),
            kv_lens=torch.tensor([a + b for a, b in zip(start_lens, q_lens, strict=True)], dtype=int64),
            slot_mapping=torch.tensor(slot_mapping, dtype=int64),
            state_slots=torch.tensor(
                [self._seqs[seq].slot if self._seqs[seq].slot is not None else 0 for seq in seq_ids], dtype=int64
            ),
            snapshot_at=torch.tensor(snapshot_at, dtype=int64),
            snapshot_ids=torch.tensor(snapshot_ids, dtype=int64),
            tensors=self.tensors,
        )
        self._pending = _Pending(fb, snapshot_ids)
        return fb

    def _plan_snapshots(self, s: _Sequence, n: int, wanted: set[int]) -> list[int]:
        interval = self.config.snapshot_interval
        first, last = s.length, s.length + n - 1
        planned = {p for p in wanted if first <= p <= last}
        if interval:
            planned.update(range(first + (-(first + 1)) % interval, last + 1, interval))
        # Only the newest `capacity` can survive in the ring anyway.
        return sorted(planned)[-self.config.snapshots_per_sequence :] if s.ring.capacity else []

    def end_forward(self, fb: ForwardBatch) -> None:
        """The model wrote everything `fb` described: its snapshots become restorable."""
        pending = self._take_pending(fb)
        self.snapshots.mark_complete(pending.snapshots)

    def abort_forward(self, fb: ForwardBatch) -> None:
        """The model raised mid-forward: undo the lengths, drop the batch's snapshots and mark the
        live states unusable (a later `truncate` restores them from snapshots)."""
        pending = self._take_pending(fb)
        self.snapshots.drop_pending(pending.snapshots)
        for seq, start in zip(fb.seq_ids, fb.start_lens, strict=True):
            s = self._seqs[seq]
            self._drop_verify(s)
            self._cut_blocks(s, start)
            s.length = start
            s.live_valid = start == 0
            if start == 0 and s.slot is not None:  # an empty sequence must start from zeros
                self.slots.decref(s.slot)
                s.slot = None

    def _take_pending(self, fb: ForwardBatch) -> _Pending:
        if self._pending is None or self._pending.batch is not fb:
            raise RuntimeError("this ForwardBatch is not the forward in progress")
        pending, self._pending = self._pending, None
        return pending

    def view(self, seqs: Sequence[int]) -> CacheView:
        """Where `seqs`' K/V and live states are, for a read-only pass (MTP drafting): every
        sequence must hold at least one token and a usable live state."""
        if self._pending is not None:
            raise RuntimeError("a forward is in progress: call end_forward first")
        if not seqs:
            raise ValueError("view needs at least one sequence")
        for seq in seqs:
            s = self._get(seq)
            if not s.length:
                raise ValueError(f"sequence {seq} is empty: feed at least one token first")
            if not s.live_valid:
                raise ValueError(f"sequence {seq}: its last forward failed; truncate it first")
            if s.verify is not None:
                raise ValueError(f"sequence {seq}: accept its verify forward first")
        found = [self._seqs[seq] for seq in seqs]
        width = max(len(s.block_table) for s in found)
        return CacheView(
            seq_ids=tuple(seqs),
            block_tables=torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in found]),
            kv_lens=torch.tensor([s.length for s in found]),
            state_slots=torch.tensor([s.slot if s.slot is not None else 0 for s in found]),
            tensors=self.tensors,
        )

    # -- speculative verification -------------------------------------------------------------

    def accept(self, seq: int, length: int) -> None:
        """After a forward that verified drafts for `seq`: keep its first `length` tokens (at
        least the first token that forward fed), as if only those had been fed. The KV rows past
        `length` are dropped and the live state becomes the verify row of position length-1 (or
        stays, when every fed token is kept); interval snapshots the kept tokens reached are
        taken from their rows. The verify rows are freed. Raises ValueError, changing nothing,
        when `seq`'s last forward verified nothing or `length` is outside what it fed."""
        s = self._get(seq)
        v = s.verify
        if v is None:
            raise ValueError(f"sequence {seq}: its last forward verified no drafts, there is nothing to accept")
        if self._pending is not None and seq in self._pending.batch.seq_ids:
            raise RuntimeError(f"sequence {seq} is in the forward in progress")
        if not isinstance(length, int) or not v.start < length <= s.length:
            raise ValueError(f"sequence {seq}: accept length {length!r} is outside {v.start + 1}..{s.length}")
        interval = self.config.snapshot_interval
        for p in range(v.start, length) if interval and s.ring.capacity else ():
            if (p + 1) % interval == 0 and (snap := s.ring.record(p)) is not None:
                self._save_state(snap, self._verify_row(v, p), s.slot)
                self.snapshots.mark_complete([snap])
        if length < s.length:
            self._cut_blocks(s, length)
            s.length = length
            if s.slot is not None:  # length - 1 is not the last position fed: a verify row holds it
                self._load_slot(s.slot, self._verify_row(v, length - 1))
        self._drop_verify(s)

    def _verify_row(self, v: _Verify, p: int) -> int | None:
        """The snapshot-tensor row holding the state after position p of a verify forward; None
        for its last position, whose state is the live slot's."""
        i = p - v.start
        return self.sizes.num_snapshots + v.rows[i] if i < len(v.rows) else None

    def _save_state(self, snap: int, row: int | None, slot: int | None) -> None:
        """Fill snapshot `snap` from snapshot-tensor row `row`, or from live `slot` when None."""
        t = self.tensors
        for live, saved in zip(t.live_states(), t.snapshot_states(), strict=True):
            saved[snap].copy_(saved[row] if row is not None else live[slot])

    def _drop_verify(self, s: _Sequence) -> None:
        if s.verify is not None:
            for row in s.verify.rows:
                self.verify_rows.decref(row)
            s.verify = None

    # -- fork / truncate / release ------------------------------------------------------------

    def fork(self, src: int, length: int | None = None) -> tuple[int, int]:
        """A new sequence holding `src`'s first `length` tokens (default: all).

        Returns (new sequence, keep): the child already holds `keep` tokens; the caller re-feeds
        tokens keep..length-1. With the whole live history this is O(1): blocks, slot and
        snapshots are shared by reference and copied only when written.
        """
        s = self._get(src)
        if s.verify is not None:
            raise ValueError(f"sequence {src}: accept its verify forward before forking it")
        length = s.length if length is None else length
        self._check_position(src, length)
        if len(self._seqs) >= self.config.max_sequences:
            raise CacheFull(f"{len(self._seqs)} sequences are live (CacheConfig.max_sequences)")
        share_live = length == s.length and s.live_valid
        if share_live:
            keep, best = length, None
        else:
            best = s.ring.best(length)
            keep = best[0] + 1 if best else 0
            self._check_refeed_room(s, keep, length, need_slot=length > 0, shares_table=True)
        child_id = self.add_sequence()
        child = self._seqs[child_id]
        child.length = keep
        child.block_table = s.block_table[: math.ceil(keep / self.config.block_size)]
        for block in child.block_table:
            self.blocks.incref(block)
        for pos, snap in s.ring.entries:
            if pos < keep:
                child.ring.adopt(pos, snap)
        if share_live:
            child.slot = s.slot
            if s.slot is not None:
                self.slots.incref(s.slot)
        elif length > 0 and self.spec.has_state:
            child.slot = self.slots.alloc()
            self._load_slot(child.slot, best[1] if best else None)
        return child_id, keep

    def truncate(self, seq: int, p: int) -> int:
        """Cut `seq` to its first `p` tokens, restoring the newest snapshot at a position <= p-1.

        Returns keep (that position + 1, or 0 when there is none; `p` itself when p is the
        length): the sequence now holds `keep` tokens, the caller re-feeds tokens keep..p-1. Room
        for that re-feed is checked first, so it cannot fail with CacheFull.
        """
        s = self._check_position(seq, p)
        if s.verify is not None:
            raise ValueError(f"sequence {seq}: accept its verify forward before truncating it")
        if p == s.length and s.live_valid:
            return p
        best = s.ring.best(p) if p > 0 else None
        keep = best[0] + 1 if best else 0
        self._check_refeed_room(s, keep, p, need_slot=p > 0 and self._slot_is_shared(s), shares_table=False)
        self._cut_blocks(s, keep)
        s.length = keep
        s.live_valid = True
        if best:
            s.ring.prune_after(best[0])
        else:
            s.ring.reset()
        if self.spec.has_state and s.slot is not None:
            if p == 0:
                self.slots.decref(s.slot)
                s.slot = None
            else:
                self._make_slot_private(s)
                self._load_slot(s.slot, best[1] if best else None)
        return keep

    def release(self, seq: int) -> None:
        """Forget `seq`; its blocks, slot and snapshots are freed unless another sequence shares them."""
        s = self._get(seq)
        if self._pending is not None and seq in self._pending.batch.seq_ids:
            raise RuntimeError(f"sequence {seq} is in the forward in progress")
        self._cut_blocks(s, 0)
        if s.slot is not None:
            self.slots.decref(s.slot)
        s.ring.reset()
        self._drop_verify(s)
        del self._seqs[seq]

    def can_resume(self, seq: int, p: int) -> bool:
        """True iff `truncate(seq, p)` would recompute nothing."""
        return self.restore_point(seq, p) == p

    def restore_point(self, seq: int, p: int) -> int:
        """The `keep` that `truncate(seq, p)` or `fork(seq, p)` would report; changes nothing."""
        s = self._check_position(seq, p)
        if p == 0 or (p == s.length and s.live_valid):
            return p
        best = s.ring.best(p)
        return best[0] + 1 if best else 0

    # -- helpers ------------------------------------------------------------------------------

    def _slot_is_shared(self, s: _Sequence) -> bool:
        return s.slot is None or self.slots.refcount(s.slot) > 1

    def _check_refeed_room(self, s: _Sequence, keep: int, p: int, need_slot: bool, shares_table: bool) -> None:
        """Raise CacheFull unless cutting to `keep` and re-feeding up to `p` fits."""
        bs = self.config.block_size
        kept = math.ceil(keep / bs)
        freed = 0 if shares_table else sum(1 for b in s.block_table[kept:] if self.blocks.refcount(b) == 1)
        needed = math.ceil(p / bs) - kept
        if keep % bs and p > keep and (shares_table or self.blocks.refcount(s.block_table[kept - 1]) > 1):
            needed += 1
        if needed > self.blocks.num_free + freed:
            raise CacheFull(f"KV cache full: re-feeding {p - keep} tokens needs {needed} blocks")
        if need_slot and self.spec.has_state and self.slots.num_free < 1:
            raise CacheFull("state slots full: restoring a snapshot needs a free slot")

    def _cut_blocks(self, s: _Sequence, keep: int) -> None:
        kept = math.ceil(keep / self.config.block_size)
        for block in s.block_table[kept:]:
            self.blocks.decref(block)
        del s.block_table[kept:]

    def _make_last_block_private(self, s: _Sequence) -> None:
        if not s.length % self.config.block_size:
            return
        old = s.block_table[-1]
        if self.blocks.refcount(old) == 1:
            return
        new = self.blocks.alloc()
        for pool in (*self.tensors.key, *self.tensors.value):
            pool[new].copy_(pool[old])
        self.blocks.decref(old)
        s.block_table[-1] = new

    def _make_slot_private(self, s: _Sequence) -> None:
        if s.slot is not None and self.slots.refcount(s.slot) == 1:
            return
        new = self.slots.alloc()
        for pool in self.tensors.live_states():
            if s.slot is None:
                pool[new].zero_()
            else:
                pool[new].copy_(pool[s.slot])
        if s.slot is not None:
            self.slots.decref(s.slot)
        s.slot = new

    def _load_slot(self, slot: int, snap: int | None) -> None:
        """Fill `slot` with snapshot `snap`, or zeros (the state before any token)."""
        t = self.tensors
        for live, saved in zip(t.live_states(), t.snapshot_states(), strict=True):
            if snap is None:
                live[slot].zero_()
            else:
                live[slot].copy_(saved[snap])

    # -- export and import (the disk tier) -----------------------------------------------------

    def block_table(self, seq: int) -> list[int]:
        return list(self._get(seq).block_table)

    def pin_blocks(self, blocks: Iterable[int]) -> None:
        """Hold `blocks` (one reference each) while a reader outside the step loop copies them:
        a held block is never freed, and shared blocks are copied before any write."""
        for block in blocks:
            self.blocks.incref(block)
            self._pinned[block] += 1

    def unpin_blocks(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._pinned[block] -= 1
            if not self._pinned[block]:
                del self._pinned[block]
            self.blocks.decref(block)

    def restorable_states(self, seq: int, lengths: Iterable[int]) -> dict[int, list[torch.Tensor]]:
        """Copies of the recurrent states (`live_states` order) after the first n tokens, for each
        n in `lengths` that `seq` can restore exactly: its complete snapshots and its live state."""
        s = self._get(seq)
        wanted = set(lengths)
        found: dict[int, list[torch.Tensor]] = {}
        t = self.tensors
        if s.length in wanted and s.live_valid and s.slot is not None:
            found[s.length] = [pool[s.slot].clone() for pool in t.live_states()]
        for pos, snap in s.ring.entries:
            if pos + 1 in wanted and pos + 1 not in found and self.snapshots.is_complete(snap):
                found[pos + 1] = [pool[snap].clone() for pool in t.snapshot_states()]
        return found

    def restore_lengths(self, seq: int) -> list[int]:
        """Every n whose state `restorable_states` can give: complete snapshots and the live length."""
        s = self._get(seq)
        lengths = {pos + 1 for pos, snap in s.ring.entries if self.snapshots.is_complete(snap)}
        if s.live_valid and s.slot is not None:
            lengths.add(s.length)
        return sorted(lengths)

    def import_sequence(self, length: int, rows: list[list[torch.Tensor]], states: list[torch.Tensor]) -> int:
        """A new sequence of `length` tokens from saved data: `rows[b]` is block b's K/V rows,
        `[key of attention layer 0, ..., value of layer 0, ...]` each `[n_b, Hkv, hd]`; `states` the
        recurrent state after token length-1 (`live_states` order). CacheFull before any change."""
        bs = self.config.block_size
        n_blocks = math.ceil(length / bs)
        pools = (*self.tensors.key, *self.tensors.value)
        if length < 1 or len(rows) != n_blocks:
            raise ValueError(f"{len(rows)} blocks of rows do not hold {length} tokens")
        for b, block_rows in enumerate(rows):
            n = min(bs, length - b * bs)
            if [tuple(r.shape) for r in block_rows] != [(n, *pool.shape[2:]) for pool in pools]:
                raise ValueError(f"block {b}: saved rows do not fit this cache's KV shapes")
        if [tuple(t.shape) for t in states] != [tuple(pool.shape[1:]) for pool in self.tensors.live_states()]:
            raise ValueError("saved states do not fit this cache's recurrent state shapes")
        if len(self._seqs) >= self.config.max_sequences:
            raise CacheFull(f"{len(self._seqs)} sequences are live (CacheConfig.max_sequences)")
        if n_blocks > self.blocks.num_free:
            raise CacheFull(f"KV cache full: restoring {length} tokens needs {n_blocks} blocks")
        linear = self.spec.num_linear_layers > 0
        if linear and self.slots.num_free < 1:
            raise CacheFull("state slots full: restoring a sequence needs a free slot")
        seq = self.add_sequence()
        s = self._seqs[seq]
        for block_rows in rows:
            block = self.blocks.alloc()
            s.block_table.append(block)
            for pool, saved in zip(pools, block_rows, strict=True):
                pool[block, : len(saved)].copy_(saved)
        if linear:
            s.slot = self.slots.alloc()
            for pool, saved in zip(self.tensors.live_states(), states, strict=True):
                pool[s.slot].copy_(saved)
            snap = s.ring.record(length - 1)  # a restore point, as the forward that computed it left one
            if snap is not None:
                for pool, saved in zip(self.tensors.snapshot_states(), states, strict=True):
                    pool[snap].copy_(saved)
                self.snapshots.mark_complete([snap])
        s.length = length
        return seq

    # -- integrity and accounting -------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError unless refcounts equal references, free + used = total for blocks,
        slots and snapshots, and no sequence points at a freed object."""
        bs = self.config.block_size
        block_refs: dict[int, int] = {}
        slot_refs: dict[int, int] = {}
        row_refs: dict[int, int] = {}
        for seq, s in self._seqs.items():
            if s.verify is not None:
                if len(s.verify.rows) > s.length - s.verify.start:
                    raise IntegrityError(f"sequence {seq}: more verify rows than tokens fed since {s.verify.start}")
                for row in s.verify.rows:
                    row_refs[row] = row_refs.get(row, 0) + 1
            if len(s.block_table) != math.ceil(s.length / bs):
                raise IntegrityError(f"sequence {seq}: {len(s.block_table)} blocks for {s.length} tokens")
            for block in s.block_table:
                block_refs[block] = block_refs.get(block, 0) + 1
            if s.slot is not None:
                slot_refs[s.slot] = slot_refs.get(s.slot, 0) + 1
            elif s.length and self.spec.has_state:
                raise IntegrityError(f"sequence {seq} holds {s.length} tokens but no state slot")
            if len(s.ring.entries) > s.ring.capacity:
                raise IntegrityError(f"sequence {seq}: ring over capacity")
            for pos, _ in s.ring.entries:
                if pos >= s.length and self._pending is None:
                    raise IntegrityError(f"sequence {seq}: snapshot at {pos} beyond length {s.length}")
        for block, pins in self._pinned.items():
            block_refs[block] = block_refs.get(block, 0) + pins
        self.blocks.check(block_refs)
        self.slots.check(slot_refs)
        self.verify_rows.check(row_refs)
        self.snapshots.check_integrity([s.ring for s in self._seqs.values()])

    def memory(self) -> dict[str, int]:
        """Bytes allocated and in use, by pool."""
        z, spec = self.sizes, self.spec
        block_bytes = spec.kv_bytes_per_token * self.config.block_size
        state = spec.state_bytes_per_sequence
        return {
            "kv_bytes_total": z.kv_bytes,
            "kv_bytes_used": self.blocks.num_used * block_bytes,
            "state_bytes_total": z.state_bytes,
            "state_bytes_used": self.slots.num_used * state,
            "snapshot_bytes_total": z.snapshot_bytes,
            "snapshot_bytes_used": self.snapshots.ids.num_used * state,
            "verify_bytes_total": z.verify_bytes,
        }
