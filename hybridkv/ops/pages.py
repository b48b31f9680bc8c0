"""Weights on transparent huge pages (2 MiB), where Linux lends them on request.

A decode step streams every weight once: hundreds of MB through 4 KiB pages, a TLB miss every
4 KiB. Most distributions set `transparent_hugepage/enabled` to `madvise`, so memory gets 2 MiB
pages only where a process asks for them (`MADV_HUGEPAGE`), and neither PyTorch's allocator nor
llama.cpp asks. `move` copies the weights onto such pages once at load (a GGUF file's pages are
released after). Measured on the Qwen3.5-0.8B shape's Q4_K_M file (Zen 4, 2 threads, same-process
A/B): a Q6_K product of the 248k-row head's shape 12-15% faster from memory, a whole decode step
2-7% (README, "Where decode time goes"). The cache's K/V and live recurrent-state pools, which a
step streams too, are allocated here (`zeros`): at 4,096 tokens of context a step 7% faster.

`HYBRIDKV_HUGE_PAGES=0` turns it off. Without Linux's transparent huge pages (another OS, or
`enabled` = `never`), `move` does nothing and `zeros` is `torch.zeros`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SPARE = 512 << 20  # memory left over while a storage and its copy are both held
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Can this process ask for huge pages: Linux with transparent huge pages not `never`, and not
    turned off by `HYBRIDKV_HUGE_PAGES=0`."""
    if os.environ.get("HYBRIDKV_HUGE_PAGES", "1").strip() == "0":
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def available_memory() -> int:
    """Bytes of memory available to a new allocation: MemAvailable, else free physical pages."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _huge_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of private anonymous memory starting on a 2 MiB boundary, advised to huge pages.
    The tensor keeps the mapping alive; it is unmapped with the tensor's storage."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: plain ones, same memory
        buf.madvise(mmap.MADV_HUGEPAGE, offset, len(buf) - offset)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)`, on huge pages where they are `available` and the tensor
    spans one. Every page is written here, as `torch.zeros` does, so the memory is taken now
    (a budget that fits at start-up stays fitted), not when a later write first touches it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not available() or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    try:
        t = _huge_bytes(nbytes).view(dtype).view(shape)
    except OSError:  # the kernel refused the mapping (an overcommit limit)
        return torch.zeros(shape, dtype=dtype)
    return t.zero_()


def move(tensors: Iterable[torch.Tensor]) -> int:
    """Copy the storage of each CPU tensor that spans a huge page onto huge pages, once however
    many of `tensors` view it, and point those tensors at the copy (same values, offsets, shapes
    and strides: views stay views). The old storage is freed once nothing else holds it; a
    memory-mapped file's pages stay mapped until its owner releases them. Returns the bytes moved
    (0 where huge pages are not `available`)."""
    if not available():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.nbytes() >= HUGE_PAGE:
            group = groups.setdefault(storage.data_ptr(), [])
            if not any(t is seen for seen in group):
                group.append(t)
    moved = 0
    with torch.no_grad():
        for group in groups.values():
            old = group[0].untyped_storage()
            if old.nbytes() + SPARE > available_memory():
                continue  # the copy and the original would not fit together: it stays as it is
            try:
                copy = _huge_bytes(old.nbytes())
            except OSError:  # the kernel refused the mapping (an overcommit limit): it stays too
                continue
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in group:
                start = t.storage_offset() + copy.storage_offset() // t.element_size()
                t.set_(copy.untyped_storage(), start, t.shape, t.stride())
            moved += old.nbytes()
    return moved
