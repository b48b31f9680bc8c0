"""The disk tier under the prefix index: what a sequence leaves on disk, and how a prompt finds it.

When a sequence enters the prefix index, `save` queues its K/V blocks and the recurrent states
at its restore points (complete snapshots, and the live state at its length) that are not on
disk yet. The states are copied at once (they live in pools that evict); the blocks are pinned
(one reference each) and a writer thread copies and writes them one at a time, then the states:
a state file on disk means its blocks were written before it. The engine unpins written blocks
at its next step (`release_written`), and under memory pressure drops queued writes
(`drop_pending`): an entry evicted before its write is simply not on disk.

Names are content addresses: `prefix_name(n)` hashes the first n tokens, chained block by block
from the model key, so a prompt's candidate restore lengths are found without reading a file.
A block file holds the rows of the block that ends at n (a partial block when n is not a
multiple of the block size); a state file the recurrent state after token n-1.

    tokens:  | block 0 | block 1 | block 2 |...      chain[j] = H(chain[j-1] + tokens of block j-1)
    n = 40 (block 16):  h16.kv  h32.kv  h40.kv  h40.state   h40 = H(chain[2] + tokens 32..39)

`restore` (RAM missed or kept fewer tokens) takes the longest n <= limit whose state and blocks
are all present and good, and builds a sequence of n tokens from them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.cached_model import CachedModel
from hybridkv.engine.disk_store import DiskStore, default_budget, default_cache_dir
from hybridkv.models.sources import ResolvedModel

log = logging.getLogger("hybridkv.disk")

# Bump when the layout of a block or state file, or what a state holds, changes.
CACHE_FORMAT_VERSION = 1
_HEADER_BYTES = 1 << 20  # of a GGUF file or another checkpoint file, hashed into the model key
_SAMPLES = 16


def model_key(source: ResolvedModel, cm: CachedModel, quantize: str | None) -> tuple[bytes, dict[str, Any]]:
    """The key every file of this model is written under, and a description of it: the
    checkpoint's file names, sizes and headers (the safetensors JSON header; a GGUF file's first
    MiB, which holds its metadata; an ollama blob's name is its digest) plus 64 KiB sampled from
    each file, the compute dtype, the quantization, the cache's shapes and block size, and
    `CACHE_FORMAT_VERSION`. Never a hash of all the weights: the key costs milliseconds."""
    files = source.gguf_parts or tuple(sorted(p for p in source.path.iterdir() if p.is_file()))
    fingerprint = []
    for path in files:
        fingerprint.append([path.name, path.stat().st_size, _header_digest(path)])
    spec, config = cm.cache.spec, cm.cache.config
    what = {
        "format": CACHE_FORMAT_VERSION,
        "files": fingerprint,
        "dtype": str(cm.dtype),
        "quantize": quantize,
        "block_size": config.block_size,
        "spec": repr(spec),
        "states": [list(t.shape[1:]) for t in cm.cache.tensors.live_states()],
    }
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).digest()
    about = {"model": source.description, "dtype": str(cm.dtype), "quantize": quantize, "format": CACHE_FORMAT_VERSION}
    return key, about


def _header_digest(path: Path) -> str:
    """The file's header, and 16 samples of 4 KiB spread over it: two checkpoints of one shape
    (a base model and its fine-tune) have equal headers and sizes, never equal samples."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":  # 8 bytes of length, then the JSON header
            length = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(length, 64 << 20)))
        else:
            digest.update(f.read(_HEADER_BYTES))
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            digest.update(f.read(4096))
    return digest.hexdigest()


def open_disk_tier(
    source: ResolvedModel,
    cm: CachedModel,
    quantize: str | None,
    directory: str | Path | None = None,
    budget: int | None = None,
) -> DiskTier | None:
    """The disk tier for `LLM(cache_dir=, cache_disk=)`: off unless one is given; `budget` 0 is
    off, None min(10% of free disk, 20 GiB); `directory` None the user cache directory."""
    if (directory is None and budget is None) or budget == 0:
        return None
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ValueError(f"cache_disk must be a byte count >= 0 (0: off), got {budget!r}")
    root = Path(directory).expanduser() if directory is not None else default_cache_dir()
    budget = default_budget(root) if budget is None else budget
    key, about = model_key(source, cm, quantize)
    try:
        store = DiskStore(root, key, budget, about)
    except OSError as e:
        raise ValueError(f"cache directory {root}: {e.strerror or e}") from None
    log.info("disk cache: %s, up to %d bytes", store.dir, budget)
    return DiskTier(cm, store)


class PrefixNames:
    """Content addresses of a prompt's prefixes (see the module docstring)."""

    def __init__(self, key: bytes, tokens: list[int], block_size: int) -> None:
        self.tokens = tokens
        self.bs = block_size
        self.chain = [hashlib.blake2b(key, digest_size=16).digest()]
        packed = array("i", tokens).tobytes()
        for j in range(len(tokens) // block_size):
            self.chain.append(_hash(self.chain[-1], packed[4 * j * block_size : 4 * (j + 1) * block_size]))

    def __call__(self, n: int) -> str:
        j, rest = divmod(n, self.bs)
        if not rest:
            return self.chain[j].hex()
        return _hash(self.chain[j], array("i", self.tokens[j * self.bs : n]).tobytes()).hex()

    def block_names(self, n: int) -> list[tuple[str, int]]:
        """(file name, rows) of the blocks holding tokens 0..n-1."""
        ends = [*range(self.bs, n + 1, self.bs), *([n] if n % self.bs else [])]
        return [(self(end) + ".kv", end - (math.ceil(end / self.bs) - 1) * self.bs) for end in ends]


def _hash(prev: bytes, packed: bytes) -> bytes:
    return hashlib.blake2b(prev + packed, digest_size=16).digest()


@dataclass(eq=False)
class _Write:
    blocks: list[tuple[str, int, int]]  # (file name, block id, rows)
    states: list[tuple[str, list[torch.Tensor]]]
    pinned: list[int]  # blocks still pinned (emptied when the engine unpins them)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    copied: bool = False


class DiskTier:
    """Engine-facing: `save` and `restore` run on the engine's thread, the writes on a thread of
    their own. `close` writes what is queued and stops."""

    def __init__(self, cm: CachedModel, store: DiskStore) -> None:
        self.cm = cm
        self.store = store
        self.read_seconds = 0.0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._writes: list[_Write] = []  # queued or being written, pins held (engine thread only)
        self._queued: set[str] = set()  # names queued and not written yet
        self._names_lock = threading.Lock()
        self._thread: threading.Thread | None = threading.Thread(target=self._writer, name="hybridkv-disk", daemon=True)
        self._thread.start()

    # -- writing (engine thread) --------------------------------------------------------------

    def save(self, seq: int) -> None:
        """Queue `seq`'s restore points and the blocks under them that are not on disk yet."""
        if self._thread is None:
            return
        cache = self.cm.cache
        names = PrefixNames(self.store.key, self.cm.tokens(seq), cache.config.block_size)
        present = self.store.names()
        with self._names_lock:
            known = present | self._queued
            lengths = [n for n in cache.restore_lengths(seq) if names(n) + ".state" not in known]
            if not lengths:
                return
            table = cache.block_table(seq)
            blocks: dict[str, tuple[int, int]] = {}
            for n in lengths:
                for j, (name, rows) in enumerate(names.block_names(n)):
                    if name not in known:
                        blocks[name] = (table[j], rows)
            states = [(names(n) + ".state", s) for n, s in cache.restorable_states(seq, lengths).items()]
            self._queued.update(blocks)
            self._queued.update(name for name, _ in states)
        pinned = [block for block, _ in blocks.values()]
        cache.pin_blocks(pinned)
        write = _Write([(name, block, rows) for name, (block, rows) in blocks.items()], states, pinned)
        self._writes.append(write)
        self._queue.put(write)

    def release_written(self) -> bool:
        """Unpin the blocks of writes that have copied them; True if any were unpinned."""
        done = [w for w in self._writes if w.copied]
        for write in done:
            self._unpin(write)
        return bool(done)

    def drop_pending(self) -> bool:
        """Memory is short: unpin written blocks, and cancel the writes still copying theirs
        (waiting at most for one block's copy, never for a disk write). True if any were unpinned."""
        freed = self.release_written()
        for write in list(self._writes):
            with write.lock:
                write.cancelled = True
            self._unpin(write)
            freed = True
        return freed

    def _unpin(self, write: _Write) -> None:
        self.cm.cache.unpin_blocks(write.pinned)
        write.pinned = []
        self._writes.remove(write)

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed), then unpin (engine thread)."""
        if self._thread is not None:
            self._queue.join()
        self.release_written()

    def close(self) -> None:
        """Write what is queued, unpin, and stop the writer; later `save`s do nothing."""
        if self._thread is None:
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        self.store.close()

    # -- the writer thread --------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            write = self._queue.get()
            try:
                if write is None:
                    return
                self._write(write)
            except Exception:  # a bug: this entry is not on disk; keep writing the next ones
                log.exception("disk cache: a write failed")
            finally:
                if write is not None:
                    write.copied = True
                    with self._names_lock:
                        self._queued.difference_update(name for name, *_ in (*write.blocks, *write.states))
                self._queue.task_done()

    def _write(self, write: _Write) -> None:
        tensors = self.cm.cache.tensors
        pools = (*tensors.key, *tensors.value)
        for name, block, rows in write.blocks:
            with write.lock:
                if write.cancelled:
                    return
                copies = [pool[block, :rows].clone() for pool in pools]
            if not self.store.write(name, [_raw(t) for t in copies]):
                return  # a state without all its blocks would be useless
        write.copied = True  # the engine may unpin now; the states are copies
        for name, states in write.states:
            self.store.write(name, [_raw(t) for t in states])

    # -- reading (engine thread) --------------------------------------------------------------

    def restore(self, ids: list[int], limit: int, better_than: int) -> tuple[int, int] | None:
        """A new sequence holding the longest prefix of `ids` (at most `limit` tokens, more than
        `better_than`) that the disk can restore: (sequence, tokens it holds), or None. Bad files
        are deleted and skipped. CacheFull (no room) before any change."""
        if self._thread is None:  # closed
            return None
        present = self.store.names()
        if not present:
            return None
        names = PrefixNames(self.store.key, ids, self.cm.cache.config.block_size)
        for n in range(min(limit, len(ids)), better_than, -1):
            state_name = names(n) + ".state"
            if state_name not in present:
                continue
            blocks = names.block_names(n)
            if any(name not in present for name, _ in blocks):
                continue
            seq = self._load(ids[:n], state_name, blocks)
            if seq is not None:
                return seq, n
        return None

    def _load(self, tokens: list[int], state_name: str, blocks: list[tuple[str, int]]) -> int | None:
        cache = self.cm.cache
        start = time.perf_counter()
        try:
            state_shapes = [(pool.shape[1:], pool.dtype) for pool in cache.tensors.live_states()]
            states = self._read(state_name, state_shapes)
            if states is None:
                return None
            row_shapes = [pool.shape[2:] for pool in (*cache.tensors.key, *cache.tensors.value)]
            rows: list[list[torch.Tensor]] = []
            for name, n in blocks:
                block = self._read(name, [((n, *shape), cache.spec.kv_dtype) for shape in row_shapes])
                if block is None:
                    return None
                rows.append(block)
            return self.cm.import_prefix(tokens, rows, states)
        finally:
            self.read_seconds += time.perf_counter() - start

    def _read(self, name: str, layout: list[tuple[Any, torch.dtype]]) -> list[torch.Tensor] | None:
        payload = self.store.read(name)
        if payload is None:
            return None
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layout]
        if sum(sizes) != len(payload):
            self.store.discard(name, f"holds {len(payload)} bytes, this model's layout {sum(sizes)}")
            return None
        out, at = [], 0
        for (shape, dtype), size in zip(layout, sizes, strict=True):
            if size:
                out.append(torch.frombuffer(payload[at : at + size], dtype=torch.uint8).view(dtype).reshape(shape))
            else:
                out.append(torch.empty(shape, dtype=dtype))
            at += size
        return out

    # -- generated answers --------------------------------------------------------------------

    def save_answer(self, text: str, ids: list[int]) -> None:
        """Keep the ids an answer was generated as: after a restart, a client sending the answer
        back as text is encoded to those ids again (re-encoding text can differ), so its cached
        prefix still matches. Any thread."""
        if self._thread is not None:
            self.store.write(self._answer_name(text), [array("i", ids).tobytes()])

    def load_answer(self, text: str) -> list[int] | None:
        if self._thread is None:
            return None
        payload = self.store.read(self._answer_name(text))
        if payload is None:
            return None
        ids = array("i")
        ids.frombytes(payload)
        return ids.tolist()

    def _answer_name(self, text: str) -> str:
        return hashlib.blake2b(self.store.key + text.encode(), digest_size=16).hexdigest() + ".answer"

    def metrics(self) -> dict[str, float]:
        return {
            "disk_bytes_used": self.store.bytes_used,
            "disk_read_seconds": self.read_seconds,
            "disk_write_seconds": self.store.write_seconds,
        }


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
