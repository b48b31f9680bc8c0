"""Where hybridkv's decode time goes, by part of the model and by op family.

    python -m hybridkv.bench.profile [--shape NAME | --model DIR] [--cache-dir DIR] [--dtype D] [--batch N] [--steps N]

Without --model it builds a bench shape (`workload.SHAPES`, as `hybridkv bench --shape`;
transformers needed). It prefills `batch` random 512-token prompts, then times decode steps two
ways: wall time per part of the model (timers around each module), and self time per op family
(torch.profiler). Both run the decoder layers op by op (`layers_op_by_op`): a decode step
otherwise takes each layer in one C++ call (`native.decode_layer`), which neither can split; the
kernels are the same, the Python and dispatch between them (1–1.5 ms a 0.8B Q4_K step) are not.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hybridkv.cached_model import CachedModel
from hybridkv.models import Qwen3NextModel
from hybridkv.models.qwen3_next import layers_op_by_op

# aten op -> family; anything else is "elementwise and other small ops".
FAMILIES = {
    "weight matmuls (rows_matmul[_t], mm, bmm)": (
        "hybridkv::rows_matmul",
        "hybridkv::rows_matmul_t",
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm_",
    ),
    "MoE block (C++ moe_block)": ("hybridkv::moe_block",),
    "linear-attention step (C++)": ("hybridkv::gdn_forward",),
    "attention step (C++)": ("hybridkv::attention_decode",),
    "expert weight / state / KV gathers": ("aten::index_select",),
    "cache writes (state, KV)": ("aten::index_copy_",),
    "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "norms (rms_norm, l2)": (
        "hybridkv::rms_norm",
        "aten::_fused_rms_norm",
        "aten::rms_norm",
        "aten::linalg_vecdot",
        "aten::rsqrt",
    ),
    "k-split sums, reductions": ("aten::sum",),
    "copies, casts, concatenation": ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::masked_fill_"),
}


def part_times(cm: CachedModel, step: Callable[[], object], steps: int) -> dict[str, float]:
    """Mean ms per step spent in each kind of module (and outside them), the layers op by op."""
    totals: dict[str, float] = defaultdict(float)
    with _timers(cm.model, totals), layers_op_by_op():
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    model = totals.pop("model")
    inside = sum(totals.values())
    parts = {name: 1e3 * t / steps for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}
    parts["embedding, final norm, lm_head"] = 1e3 * (model - inside) / steps
    parts["cache bookkeeping and feed() outside the model"] = 1e3 * (wall - model) / steps
    return parts


@contextmanager
def _timers(model: Qwen3NextModel, totals: dict[str, float]) -> Iterator[None]:
    started: dict[int, float] = {}
    handles = []

    def watch(module: nn.Module, name: str) -> None:
        def pre(mod: nn.Module, args: object) -> None:
            started[id(mod)] = time.perf_counter()

        def post(mod: nn.Module, args: object, out: object) -> None:
            totals[name] += time.perf_counter() - started[id(mod)]

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    watch(model, "model")
    parts = [
        (attr, getattr(layer, attr)) for layer in model.layers for attr in ("input_norm", "mixer", "post_norm", "ffn")
    ]
    kinds = ["layer RMSNorms" if attr.endswith("norm") else type(module).__name__ for attr, module in parts]
    for (_, module), kind in zip(parts, kinds, strict=True):
        watch(module, f"{kind} x{kinds.count(kind)}")
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def op_families(step: Callable[[], object], steps: int) -> dict[str, float]:
    """Mean ms of profiler self time per step for each op family, the layers op by op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, layers_op_by_op():
        for _ in range(steps):
            step()
    family_of = {op: family for family, ops in FAMILIES.items() for op in ops}
    out: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        out[family_of.get(event.key, "elementwise and other small ops")] += event.self_cpu_time_total / 1e3 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> None:
    from hybridkv.bench import DTYPES
    from hybridkv.bench.workload import DEFAULT_SHAPE, SHAPES, cached_checkpoint

    parser = argparse.ArgumentParser(prog="python -m hybridkv.bench.profile", description=__doc__)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE, help="the random model to build")
    model.add_argument("--model", metavar="DIR", help="checkpoint directory instead of a built shape")
    parser.add_argument("--cache-dir", metavar="DIR", type=Path, help="build the shape here once (as bench)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and compute (float32)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together (default 1)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="hybridkv-profile-") as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            model_dir = cached_checkpoint(SHAPES[args.shape], dtype, args.cache_dir or Path(tmp), log=print)
        cm = CachedModel.load(model_dir, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    seqs = [cm.new_sequence() for _ in range(args.batch)]
    cm.feed({s: torch.randint(0, cm.vocab_size, (512,), generator=gen).tolist() for s in seqs}, logits="last")

    def step() -> None:
        cm.feed({s: [int(torch.randint(0, cm.vocab_size, (1,), generator=gen))] for s in seqs}, logits="last")

    for _ in range(4):
        step()
    for title, figures in (
        ("by part of the model (wall ms per step)", part_times(cm, step, args.steps)),
        ("by op family (profiler self ms per step)", op_families(step, args.steps)),
    ):
        total = sum(figures.values())
        print(f"decode batch {args.batch}, {title}: {total:.2f} ms")
        for name, ms in figures.items():
            print(f"  {name:48s} {ms:6.2f}  {100 * ms / total:4.0f}%")


if __name__ == "__main__":
    main()
