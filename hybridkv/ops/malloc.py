"""Keep freed activation buffers in the process instead of handing them back to the kernel.

A decode step allocates and frees the same large tensors every step (the logits of 8 sequences
over a 248k vocabulary are 8 MB, a layer's projections a few MB). glibc serves such sizes with
fresh `mmap` pages or trims them off the heap when freed, so every step faults the pages in again
and the kernel zeroes them: 9% of a batch-8 decode step's CPU time on the Qwen3.5-0.8B shape
(`clear_page_erms` under `perf`). Raising glibc's mmap and trim thresholds keeps those buffers in
the heap for reuse, as llama.cpp keeps its compute buffers. Memory the process returns to the
kernel then comes back only at exit or by `malloc_trim`; the resident size stays at the peak of
what the steps used, never above it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations below this are served from the heap (glibc's own ceiling for its adaptive threshold
# is 32 MiB); freed heap memory above this much at the top is returned to the kernel.
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def give_back_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's `malloc_trim(0)`): after load,
    where the copies that replaced freed tensors would otherwise leave their memory resident
    twice. False where this is not glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's thresholds once per process; False where this is not glibc or the user set
    either threshold through glibc's own environment variables (theirs then stands)."""
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not Linux, or musl and other C libraries without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
