"""Whether decode's tiled products fetch their weights ahead in software, chosen by measurement.

At one activation row a tiled product (`Q4_K_T`, `Q6_K_T`) reads each weight byte once, at a few
operations a cache line. Hosts disagree on what keeps that stream at the memory's bandwidth: on a
Zen 5 host the out-of-order window alone kept too few lines in flight (one core read 21 GB/s where
a sum reads 41), and asking for the bytes 2 KiB ahead made the 0.8B Q4_K_M decode step 1.27x
faster; on a Zen 4 host a software prefetch of the same streams (the next tile, into L2) made
decode slower (0.88x), its hardware prefetcher following them better alone. So when a model
loads, `tune` times its largest tiled weight at one row both ways, alternating, and keeps the
faster (`native_stream_ahead`, read by every tiled product of up to 8 rows). Either way the
products are the same numbers, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from hybridkv.ops import native
from hybridkv.ops.quant.k_dot import Q4_K_T, Q6_K_T, native_k_matmul, native_stream_ahead, native_tiles_q4_k
from hybridkv.ops.quant.linear import QuantLinear
from hybridkv.ops.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)


def last_level_cache_bytes(path: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache of CPU 0 as sysfs gives it ("32768K", "300M"); 0 where unknown."""
    sizes = [0]
    for index in path.glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def held_weights(model: torch.nn.Module) -> Iterator[QuantizedWeight]:
    """The file-block weights a model's modules hold, as attributes or parts of a `QuantLinear`."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantizedWeight):
                yield value
            elif isinstance(value, QuantLinear):
                yield from (p for p in value.parts if isinstance(p, QuantizedWeight))


def tune(weights: Iterable[QuantizedWeight], reps: int = 5) -> bool | None:
    """Time the largest 2-D tiled weight of `weights` at one activation row with and without the
    fetch ahead, alternating `reps` times each, keep the faster and return it. None, the setting
    left as it is, where there is nothing to measure: no tiled products in this build, or no
    tiled weight of more than twice the last-level cache (one that fits would be timed from it)."""
    if not native.enabled() or not native_tiles_q4_k():
        return None
    tiled = [w for w in weights if w.btype.ggml_type in (Q4_K_T, Q6_K_T) and len(w.shape) == 2 and w.has_kernel]
    if not tiled:
        return None
    w = max(tiled, key=lambda w: w.nbytes)
    if w.nbytes <= 2 * last_level_cache_bytes():
        return None
    x = torch.randn(1, w.shape[1])
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps + 1):
        for on in (True, False) if rep % 2 else (False, True):
            native_stream_ahead(on)
            start = time.perf_counter()
            native_k_matmul(x, w.blocks, int(w.btype.ggml_type))
            if rep:  # the first of each is a warm-up
                times[on].append(time.perf_counter() - start)
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    keep = with_ <= without
    native_stream_ahead(keep)
    log.info(
        "decode products %s their weights ahead: a %.0f MB weight at one row %.2f ms with, %.2f ms without",
        "fetch" if keep else "do not fetch",
        w.nbytes / 1e6,
        1e3 * with_,
        1e3 * without,
    )
    return keep
