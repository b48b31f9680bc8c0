"""The disk tier's files: one directory per model key, one checksummed file per block of K/V rows
or recurrent state, written atomically under an inter-process lock, evicted least recently used
within a byte budget.

    DIR/                          0700; prompts are private
      lock                        flock: one writer at a time (write + rename, eviction, deletion)
      <model key>/                0700
        model.json                what the key stands for (`hybridkv cache ls`)
        <prefix hash>.kv          the K/V rows of one block of tokens          0600
        <prefix hash>.state       the recurrent state after those tokens      0600
        <text hash>.answer        the token ids of a generated answer (its text may not encode back to them)
        .tmp-*                    being written; a crash leaves one, the next writer deletes it

Every file starts with a header (magic, model key, its own name, payload length, crc32): a
truncated, corrupt, renamed or foreign file is a miss, deleted and logged, never an error. Readers
take no lock: a file appears by `rename`, whole, or not at all.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import signal
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridkv.disk")

MAGIC = b"HKVDISK1"
HEADER = struct.Struct("<8s32s16sQI")  # magic, model key, file name digest, payload bytes, crc32
SUFFIXES = (".kv", ".state", ".answer")
# Set by the fault tests: the writing process kills itself between a temp write and its rename.
KILL_BEFORE_RENAME = "HYBRIDKV_TEST_KILL_BEFORE_RENAME"


def default_cache_dir() -> Path:
    """Under the user cache directory: $XDG_CACHE_HOME/hybridkv/prefix, else ~/.cache/hybridkv/prefix."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridkv" / "prefix"


def default_budget(directory: Path) -> int:
    """min(10% of the free disk where `directory` is (or would be), 20 GiB)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stat = os.statvfs(probe)
    return min(stat.f_bavail * stat.f_frsize // 10, 20 << 30)


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


class DiskStore:
    """The files of one model key under `root`, within `budget` bytes for the whole of `root`.

    Thread-safe; one `DiskStore` per process and model. `write`, `read` and `discard` never
    raise for I/O trouble: a failed write is logged and skipped, a bad file is a miss."""

    def __init__(self, root: Path, key: bytes, budget: int, about: dict[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.key = key
        self.budget = budget
        self.dir = self.root / key.hex()[:32]
        make_private_dir(self.root)
        make_private_dir(self.dir)
        self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._thread_lock = threading.Lock()
        self._names: set[str] = set()
        self._listed = -1  # the directory's mtime when `_names` was listed
        self.bytes_used = 0
        self.write_seconds = 0.0
        with self._locked():
            for stale in self.dir.glob(".tmp-*"):  # nobody writes without the lock: a crash left it
                log.warning("disk cache: %s: left by an interrupted write; deleted", stale)
                stale.unlink(missing_ok=True)
            if about is not None and not (self.dir / "model.json").exists():
                self._write_file("model.json", json.dumps(about, indent=1).encode(), raw=True)
            self._set_usage(_usage(self.root))  # a scan at each open: files deleted by hand counted out

    def close(self) -> None:
        os.close(self._lock_fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # The bytes under `root`, shared by every process writing there: kept in the lock file (8 bytes,
    # read and written under the lock), so that one process's writes count against the budget in
    # the others'. A count of each process's own (as before) let two writers together overrun it.
    # An empty lock file (`clear`) means unknown: the directory is scanned.

    def _usage_now(self) -> int:
        raw = os.pread(self._lock_fd, 8, 0)
        if len(raw) == 8:
            self.bytes_used = int.from_bytes(raw, "little")
        else:
            self._set_usage(_usage(self.root))
        return self.bytes_used

    def _set_usage(self, used: int) -> None:
        self.bytes_used = max(0, used)
        os.pwrite(self._lock_fd, self.bytes_used.to_bytes(8, "little"), 0)

    # -- names ------------------------------------------------------------------------------

    def names(self) -> set[str]:
        """The files present (listed again whenever the directory changed)."""
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except FileNotFoundError:  # `hybridkv cache clear` from another process
            make_private_dir(self.dir)
            mtime = os.stat(self.dir).st_mtime_ns
        if mtime != self._listed:
            self._names = {e.name for e in os.scandir(self.dir) if _is_cache_file(e.name)}
            self._listed = mtime
        return self._names

    # -- writing ----------------------------------------------------------------------------

    def write(self, name: str, parts: Sequence[bytes | memoryview]) -> bool:
        """Write `name` atomically (temp file, then rename); False when it was not written
        (larger than the budget, or the disk refused: logged)."""
        size = HEADER.size + sum(len(p) for p in parts)
        if size > self.budget:
            return False
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        header = HEADER.pack(MAGIC, self.key, _name_digest(name), size - HEADER.size, crc)
        start = time.perf_counter()
        try:
            with self._locked():
                if self._usage_now() + size > self.budget:  # to 90%: not a scan of the directory every write
                    self._evict(self.budget * 9 // 10 - size)
                self._write_file(name, header, *parts)
                self._set_usage(self.bytes_used + size)
        except OSError as e:
            why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
            log.warning("disk cache: not writing %s: %s", self.dir / name, why)
            if e.errno == errno.ENOSPC:  # make room for the next ones
                with self._locked():
                    self._evict(self._usage_now() // 2)
            return False
        finally:
            self.write_seconds += time.perf_counter() - start
        return True

    def _write_file(self, name: str, *parts: bytes | memoryview, raw: bool = False) -> None:
        tmp = self.dir / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}.part"  # never a cache file's suffix
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
            if not raw and os.environ.get(KILL_BEFORE_RENAME):
                os.kill(os.getpid(), signal.SIGKILL)
            os.rename(tmp, self.dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _evict(self, target: int) -> None:
        """Delete the least recently used files under `root` (any model) until at most `target`
        bytes are used. Called with the lock held."""
        files = sorted(_cache_files(self.root), key=lambda e: e[1])
        used = sum(size for _, _, size in files)
        dropped = freed = 0
        for path, _, size in files:
            if used <= target:
                break
            path.unlink(missing_ok=True)
            used -= size
            dropped, freed = dropped + 1, freed + size
        if dropped:
            log.warning("disk cache: evicted %d least recently used files (%d bytes): budget reached", dropped, freed)
        self._set_usage(used)

    # -- reading ----------------------------------------------------------------------------

    def read(self, name: str) -> memoryview | None:
        """The payload of `name`, checked; None when absent or bad (a bad file is deleted)."""
        path = self.dir / name
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)  # writable: tensors are made on it
                f.readinto(data)
                os.utime(f.fileno())  # used now: least recently used goes first
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("disk cache: cannot read %s: %s", path, e.strerror or e)
            return None
        why = _check(data, self.key, name)
        if why is not None:
            self.discard(name, why)
            return None
        return memoryview(data)[HEADER.size :]

    def discard(self, name: str, why: str) -> None:
        log.warning("disk cache: %s: %s; deleted (a miss, recomputed)", self.dir / name, why)
        with self._locked():
            path = self.dir / name
            with suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                self._set_usage(self._usage_now() - size)
        self._names.discard(name)

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget these files' pages (posix_fadvise DONTNEED): the next read
        comes from the disk, as after a reboot."""
        for entry in os.scandir(self.dir):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _check(data: bytearray, key: bytes, name: str) -> str | None:
    """Why `data` is not a good file `name` for `key`, or None."""
    if len(data) < HEADER.size:
        return "truncated"
    magic, file_key, digest, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a hybridkv cache file"
    if file_key != key:
        return "written for another model, dtype or cache format"
    if digest != _name_digest(name):
        return "its contents belong to another name"
    if len(data) != HEADER.size + length:
        return "truncated"
    if zlib.crc32(memoryview(data)[HEADER.size :]) != crc:
        return "checksum mismatch (corrupt)"
    return None


def _name_digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def _cache_files(root: Path) -> Iterator[tuple[Path, float, int]]:
    """(path, last used, bytes) of every block and state file under `root`."""
    for model in os.scandir(root):
        if model.is_dir(follow_symlinks=False):
            for entry in os.scandir(model.path):
                if _is_cache_file(entry.name):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    yield Path(entry.path), st.st_mtime, st.st_size


def _is_cache_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and not name.startswith(".")


def _usage(root: Path) -> int:
    return sum(size for *_, size in _cache_files(root))


def list_models(root: Path) -> list[dict[str, Any]]:
    """One row per model key directory under `root`: its description, files, bytes, last use."""
    rows: list[dict[str, Any]] = []
    if not root.is_dir():
        return rows
    for model in sorted(os.scandir(root), key=lambda e: e.name):
        if not model.is_dir(follow_symlinks=False):
            continue
        about: dict[str, Any] = {}
        with suppress(OSError, ValueError):
            about = json.loads(Path(model.path, "model.json").read_text())
        files = [e for e in os.scandir(model.path) if _is_cache_file(e.name)]
        stats = [e.stat() for e in files]
        rows.append(
            {
                "key": model.name,
                "model": about.get("model", "?"),
                "blocks": sum(e.name.endswith(".kv") for e in files),
                "states": sum(e.name.endswith(".state") for e in files),
                "bytes": sum(s.st_size for s in stats),
                "last_used": max((s.st_mtime for s in stats), default=None),
            }
        )
    return rows


def clear(root: Path) -> int:
    """Delete every cached file under `root` (under the lock); returns the bytes freed."""
    if not root.is_dir():
        return 0
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        freed = 0
        for path, _, size in list(_cache_files(root)):
            path.unlink(missing_ok=True)
            freed += size
        os.ftruncate(fd, 0)  # the stores' shared count (`DiskStore._usage_now`): unknown, scanned next
        return freed
    finally:
        os.close(fd)
