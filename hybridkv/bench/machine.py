"""The machine's limits, measured on the spot, and what they allow a scenario at best (a roofline).

Limits: memory read bandwidth (a sum over a tensor far larger than the caches) and matmul
throughput in the run's dtype (the best of a few large products, by MKL and by the GEMM prefill
uses, `ops.matmul.mm`: oneDNN's for float32), each the best of a few runs.
Where the CPU has no bfloat16 GEMM (`ops.matmul.BF16_GEMM`), bfloat16 products run widened to
float32, so a bfloat16 run's matmul limit is the float32 rate.
A scenario's floor time is max(bytes it must read / bandwidth, FLOPs it must do / matmul rate);
its fraction of the limit is floor / measured. Weights dominate both: FLOPs are 2 per active
weight per token, bytes are the weights one step reads (attention and the delta rule add a few
percent, which the floor ignores).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.models import Qwen3NextModel
from hybridkv.ops.matmul import BF16_GEMM, mm
from hybridkv.ops.quant import QuantizedWeight
from hybridkv.ops.quant.linear import QuantExperts, QuantLinear
from hybridkv.ops.quant.stream import last_level_cache_bytes


def best_time(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` runs after one warm-up: a limit is what the machine can do, and on a
    shared machine the slower runs measure the neighbours."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bytes_per_second(reps: int) -> float:
    """The machine's memory read bandwidth now: the best of `reps` sums over 256 MiB or 4x the
    last-level cache, whichever is more (a 16-core Xeon here has 300 MiB of L3, which would hold
    256 MiB between the sums)."""
    big = torch.ones(max(256 * 2**20, 4 * last_level_cache_bytes()) // 4)
    return big.numel() * big.element_size() / best_time(big.sum, reps)


@dataclass(frozen=True, slots=True)
class Limits:
    threads: int
    read_gb_s: float
    matmul_gflop_s: float
    matmul_dtype: str = "float32"

    @staticmethod
    def measure(quick: bool = False, dtype: torch.dtype = torch.float32) -> Limits:
        reps = 3 if quick else 7
        read = read_bytes_per_second(reps)
        if dtype == torch.bfloat16 and not BF16_GEMM:
            dtype = torch.float32
        best = 0.0
        for m, k, n in ((2048, 2048, 2048), (2048, 512, 2048), (512, 512, 4096)):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            for product in (torch.matmul, mm):
                best = max(best, 2 * m * k * n / best_time(functools.partial(product, a, b), reps))
        return Limits(torch.get_num_threads(), read / 1e9, best / 1e9, str(dtype).removeprefix("torch."))

    def floor_seconds(self, read_bytes: float, flops: float) -> float:
        return max(read_bytes / (self.read_gb_s * 1e9), flops / (self.matmul_gflop_s * 1e9))


@dataclass(frozen=True, slots=True)
class WeightCounts:
    """Weights of a hybridkv model by role, in elements and in bytes as held (a file's blocks count
    their bytes, so the roles of a K-quant file weigh what their types weigh).

    total: all parameters; embed: the embedding (a step reads only its rows); lm_head: the output
    layer (the embedding when tied); experts: routed expert weights; active_experts_fraction: top_k / E.
    """

    total: int
    embed: int
    lm_head: int
    experts: int
    active_experts_fraction: float
    tied: bool
    total_bytes: int
    embed_bytes: int
    lm_head_bytes: int
    experts_bytes: int

    @staticmethod
    def of(model: Qwen3NextModel) -> WeightCounts:
        """The counts of a loaded model (any family: all share Qwen3NextModel's layers), its
        weights float parameters or a file's blocks."""
        held: dict[str, Any] = dict(model.named_parameters())
        for prefix, module in model.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, (QuantizedWeight, QuantLinear, QuantExperts)):
                    held[f"{prefix}.{attr}" if prefix else attr] = value
        # Routed experts are the [E, ...] feed-forward weights, whatever the family.
        experts = [
            w
            for n, w in held.items()
            if n.endswith(("ffn.gate_up", "ffn.down"))
            and (isinstance(w, QuantExperts) or (isinstance(w, torch.Tensor) and w.dim() == 3))
        ]
        tied = "lm_head" not in held
        head = held["embed"] if tied else held["lm_head"]  # tied: embed is the output layer
        config = model.config
        return WeightCounts(
            total=sum(w.numel() for w in held.values()),
            embed=held["embed"].numel(),
            lm_head=head.numel(),
            experts=sum(w.numel() for w in experts),
            active_experts_fraction=config.num_experts_per_tok / config.num_experts if experts else 1.0,
            tied=tied,
            total_bytes=sum(w.nbytes for w in held.values()),
            embed_bytes=held["embed"].nbytes,
            lm_head_bytes=head.nbytes,
            experts_bytes=sum(w.nbytes for w in experts),
        )

    @property
    def active_per_token(self) -> int:
        """Weights one token multiplies: all but the embedding rows and the experts it did not choose."""
        body = self.total - self.embed + (self.lm_head if self.tied else 0)
        return int(body - self.experts * (1 - self.active_experts_fraction))

    def prefill_flops(self, tokens: int) -> float:
        """Last-token logits only: the output layer runs once."""
        return 2.0 * (tokens * (self.active_per_token - self.lm_head) + self.lm_head)

    def decode_bytes(self, batch: int) -> float:
        """Weights one decode step reads: all but the embedding and the routed experts, and of the
        experts those any of the batch's tokens chose (expected, for uniform top-k routing)."""
        p_unused = (1 - self.active_experts_fraction) ** batch
        body = self.total_bytes - self.embed_bytes + (self.lm_head_bytes if self.tied else 0) - self.experts_bytes
        return body + self.experts_bytes * (1 - p_unused)

    def decode_flops(self, batch: int) -> float:
        return 2.0 * batch * self.active_per_token
