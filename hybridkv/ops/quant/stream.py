"""Whether decode's weight streams are fetched ahead in software, chosen by measurement.

At one activation row a product reads each weight byte once, at a few operations a cache line.
Hosts disagree on what keeps that stream at the memory's bandwidth: on a Zen 5 host the
out-of-order window alone kept too few lines in flight (one core read a tiled Q4_K or Q6_K weight
at 21 GB/s where a sum reads 41), and asking for the bytes ahead made the 0.8B decode step 1.27x
faster at Q4_K_M (tiles, 2 KiB ahead) and 1.09-1.11x at Q8_0 (rows, 4 KiB ahead); on a Zen 4 host
the same kind of prefetch made decode slower (the next tile into L2: 0.88x; the Q8_0 head
12-40%), its hardware prefetcher following the streams better alone. So when a model loads,
`tune` times its largest such weight at one row both ways, alternating, and keeps the faster
(`native_stream_ahead`, read by the tiled K-quant products of up to 8 rows and the 32-weight
types' of one). Either way the products are the same numbers, bit for bit.
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
from hybridkv.ops.quant.k_dot import Q4_K_T, Q6_K_T, native_stream_ahead, native_tiles_q4_k
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


def streamed(w: QuantizedWeight) -> bool:
    """Does a product on `w` read the fetch-ahead setting: a 2-D weight with a C++ kernel, tiled
    (Q4_K_T, Q6_K_T) or of a 32-weight type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)?"""
    tiled = w.btype.ggml_type in (Q4_K_T, Q6_K_T) and native_tiles_q4_k()
    return len(w.shape) == 2 and w.has_kernel and (tiled or w.btype.block_elems == 32)


def tune(weights: Iterable[QuantizedWeight], reps: int = 5) -> bool | None:
    """Time the largest weight of `weights` whose product reads the setting (`streamed`) at one
    activation row with and without the fetch ahead, alternating `reps` times each, keep the faster
    and return it. None, the setting left as it is, where there is nothing to measure: no C++
    kernels, or no such weight of more than twice the last-level cache (one that fits would be
    timed from it)."""
    if not native.enabled():
        return None
    candidates = [w for w in weights if streamed(w)]
    if not candidates:
        return None
    w = max(candidates, key=lambda w: w.nbytes)
    if w.nbytes <= 2 * last_level_cache_bytes():
        return None
    x = torch.randn(1, w.shape[1])
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps + 1):
        for on in (True, False) if rep % 2 else (False, True):
            native_stream_ahead(on)
            start = time.perf_counter()
            w.matmul(x)
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
