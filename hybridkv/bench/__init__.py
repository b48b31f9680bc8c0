"""`hybridkv bench`: hybridkv and transformers side by side on the same weights, reported as ratios.

    hybridkv bench [--model DIR] [--dtype float32|bfloat16] [--quick] [--json PATH]

Without --model it builds the issue's 95M-parameter random Qwen3-Next (`workload.BENCH_MODEL`)
with transformers in a temporary directory. It measures the machine's limits, runs every
scenario through both engines in this one process, prints a table (stdout; progress on stderr)
and, with --json, writes the figures. transformers (and rich, which it brings) must be installed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.errors import NotSupported

if TYPE_CHECKING:
    from hybridkv.bench.machine import Limits
    from hybridkv.bench.scenarios import Bench, Result
    from hybridkv.bench.workload import Plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Ratios the issue asks for (> 1 = hybridkv better); scenarios without one are reported only.
TARGETS = {
    "prefill_512": 1.0,
    "decode_b1": 3.0,
    "decode_b16": 4.0,
    "chat_turn8_ttft": 0.9,
    "regenerate_ttft": 5.0,
    "edit_last_message_ttft": 5.0,
}


def add_parser(commands: Any) -> None:
    """Register `bench` on the CLI's subparsers; everything heavy is imported when it runs."""
    bench = commands.add_parser(
        "bench",
        help="measure hybridkv against transformers on the same weights",
        description="Run prefill, decode, multi-turn chat and fork scenarios through hybridkv and "
        "transformers on the same weights in one run, and print both figures and their ratio.",
    )
    bench.add_argument("--model", metavar="DIR", help="checkpoint directory (default: build a 95M random Qwen3-Next)")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and compute (float32)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions: the whole run in under 3 minutes")
    bench.add_argument("--json", metavar="PATH", type=Path, help="also write the figures to PATH as JSON")
    bench.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from hybridkv.bench.report import print_table, write_json
    from hybridkv.bench.workload import FULL, QUICK

    try:
        from rich.console import Console
    except ImportError:
        raise NotSupported("hybridkv bench prints with rich, which is not installed: pip install rich") from None
    if args.model is not None and not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model}: no such directory")
    err = Console(stderr=True)
    document = run(
        Path(args.model) if args.model else None,
        DTYPES[args.dtype],
        QUICK if args.quick else FULL,
        log=lambda line: err.print(line, style="dim", highlight=False),
        quick=args.quick,
    )
    if args.json is not None:  # first: a reader that closes the pipe early must not lose the figures
        write_json(document, args.json)
    out = Console()
    if not out.is_terminal:  # a file or a pipe: don't squeeze the table into 80 columns
        out = Console(width=160)
    print_table(document, out)
    return 0


def run(
    model_dir: Path | None,
    dtype: torch.dtype,
    plan: Plan,
    log: Callable[[str], None] = print,
    quick: bool = False,
    build_config: dict[str, Any] | None = None,
    limits: Limits | None = None,
) -> dict[str, Any]:
    """Run every scenario; returns the JSON document (see `report.to_json`).

    model_dir None builds `build_config` (default `BENCH_MODEL`) in a temporary directory;
    `limits` None measures the machine.
    """
    from hybridkv.bench.machine import Limits, WeightCounts  # noqa: F811 (TYPE_CHECKING import above)
    from hybridkv.bench.report import to_json
    from hybridkv.bench.scenarios import Bench
    from hybridkv.bench.workload import BENCH_MODEL, build_checkpoint, load_peer, require_transformers
    from hybridkv.cached_model import CachedModel

    transformers = require_transformers()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as tmp:
        if model_dir is None:
            log("building the random Qwen3-Next checkpoint with transformers")
            model_dir = build_checkpoint(Path(tmp) / "model", build_config or BENCH_MODEL)
        log(f"loading {model_dir} in both engines ({str(dtype).removeprefix('torch.')})")
        cm = CachedModel.load(model_dir, dtype=dtype)
        peer = load_peer(model_dir, dtype)
        if limits is None:
            log("measuring the machine's limits")
            limits = Limits.measure(quick, dtype)
        b = Bench(cm, peer, plan, limits, WeightCounts.of(cm.model), log)
        results = _run_scenarios(b)
    run_info = {
        "dtype": str(dtype).removeprefix("torch."),
        "quick": quick,
        "seconds": time.perf_counter() - started,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "plan": {k: getattr(plan, k) for k in ("reps", "warmup", "decode_steps")},
    }
    return to_json(results, b.limits, b.weights, run_info)


def _run_scenarios(b: Bench) -> list[Result]:
    from hybridkv.bench import scenarios

    results = []
    for name, n in zip(("prefill_512", "prefill_2048"), b.plan.prefill_lens, strict=True):
        b.log(name)
        results.append(scenarios.prefill(b, name, n, TARGETS.get(name)))
    b.log("decode_b1")
    results.append(scenarios.decode(b, 1, 1, "decode_b1", TARGETS["decode_b1"]))
    b.log("decode_b16")
    results.append(scenarios.decode(b, b.plan.batch, b.plan.peer_batch, "decode_b16", TARGETS["decode_b16"]))
    b.log("chat_turn8_ttft, regenerate_ttft, edit_last_message_ttft")
    results.extend(scenarios.chat(b, TARGETS))
    b.log("fork_n8")
    results.append(scenarios.fork(b, "fork_n8"))
    return results
