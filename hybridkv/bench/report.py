"""The bench's outputs: a rich table for people, a JSON document for scripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.bench.machine import Limits, WeightCounts
from hybridkv.bench.scenarios import Result


def to_json(results: list[Result], limits: Limits, weights: WeightCounts, run: dict[str, Any]) -> dict[str, Any]:
    """`{"scenarios": {name: {"hybridkv", "transformers", "unit", "ratio", ...}}, "machine", "model", "run"}`;
    ratio > 1 always means hybridkv is better."""
    scenarios = {
        r.name: {
            "hybridkv": r.hybridkv,
            "transformers": r.transformers,
            "unit": r.unit,
            "ratio": r.ratio,
            "better": r.better,
            "target_ratio": r.target,
            "limit": r.limit,
            "hybridkv_limit_fraction": r.limit_fraction,
            "baseline": r.baseline,
            **r.notes,
        }
        for r in results
    }
    return {
        "scenarios": scenarios,
        "machine": {
            "threads": limits.threads,
            "memory_read_gb_s": limits.read_gb_s,
            "matmul_gflop_s": limits.matmul_gflop_s,
            "matmul_dtype": limits.matmul_dtype,
        },
        "model": {
            "parameters": weights.total,
            "active_parameters_per_token": weights.active_per_token,
            "decode_bytes_per_token": weights.decode_bytes(1),
        },
        "run": run,
    }


def write_json(document: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_table(document: dict[str, Any], console: Any) -> None:
    """The table (both figures, ratio, target, the machine's limit) and the notes under it."""
    from rich.table import Table

    run, machine, model = document["run"], document["machine"], document["model"]
    title = f"hybridkv vs transformers {run['transformers_version']}: same weights, {run['dtype']}, one run"
    if run.get("quantize"):
        title = (
            f"hybridkv ({run['quantize'].upper()}) vs transformers {run['transformers_version']} ({run['dtype']}): "
            "the same weights as each engine runs them, one run"
        )
    table = Table(title=title, title_justify="left")
    for column, justify in (
        ("scenario", "left"),
        ("hybridkv", "right"),
        ("transformers", "right"),
        ("unit", "left"),
        ("ratio", "right"),
        ("target", "right"),
        ("machine limit", "right"),
        ("hybridkv / limit", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name, s in document["scenarios"].items():
        ratio = f"{s['ratio']:.2f}×"
        target = ""
        if s["target_ratio"] is not None:
            met = s["ratio"] >= s["target_ratio"]
            target = f"{'[green]' if met else '[red]'}≥ {s['target_ratio']:.2g}×"
            ratio = f"{'[green]' if met else '[red]'}{ratio}"
        limit = "" if s["limit"] is None else _num(s["limit"])
        fraction = "" if s["hybridkv_limit_fraction"] is None else f"{100 * s['hybridkv_limit_fraction']:.0f}%"
        table.add_row(name, _num(s["hybridkv"]), _num(s["transformers"]), s["unit"], ratio, target, limit, fraction)
    console.print(table)

    notes = [
        f"shape: {run['shape']} ({run['model_type']}; transformers runs {run['transformers_class']})",
        f"machine: {machine['threads']} threads, memory read {machine['memory_read_gb_s']:.1f} GB/s, "
        f"{machine['matmul_dtype']} matmul {machine['matmul_gflop_s']:.0f} GFLOP/s",
        f"model: {model['parameters'] / 1e6:.1f}M parameters, {model['active_parameters_per_token'] / 1e6:.1f}M "
        f"active per token ({model['decode_bytes_per_token'] / 2**20:.0f} MiB read per batch-1 decode step)",
        "ratio > 1: hybridkv better (time: transformers / hybridkv; tok/s: hybridkv / transformers); "
        "limit: roofline of the machine's read bandwidth and matmul rate",
    ]
    s = document["scenarios"]
    if "max_rel_err" in s.get("prefill_512", {}):
        rounding = f" (hybridkv's weights rounded to {run['quantize'].upper()})" if run.get("quantize") else ""
        notes.append(
            f"parity: last-token logits of prefill_512 agree to {s['prefill_512']['max_rel_err']:.1e}{rounding}"
        )
    if "decode_b16" in s:
        d = s["decode_b16"]
        notes.append(
            f"decode_b16: hybridkv at batch {d['hybridkv_batch']}, transformers at batch {d['transformers_batch']}"
        )
    for name in ("regenerate_ttft", "edit_last_message_ttft"):
        if name in s:
            n = s[name]
            notes.append(
                f"{name}: hybridkv computes {n['hybridkv_tokens_computed']} tokens (fork from a message-boundary "
                f"snapshot), transformers re-runs the whole {n['transformers_tokens_computed']}-token prompt"
            )
    if "fork_n8" in s:
        f = s["fork_n8"]
        notes.append(
            f"fork_n8: extra bytes hybridkv {_mb(f['hybridkv_extra_bytes'])} at fork, "
            f"{_mb(f['hybridkv_extra_bytes_after_first_token'])} once each wrote a token; "
            f"transformers {_mb(f['transformers_extra_bytes'])} (deep copies)"
        )
    structured = [name for name, x in s.items() if x.get("baseline") == "hybridkv free"]
    if structured:
        notes.append(
            f"{', '.join(structured)}: the default model writing JSON under a schema (grammar mask in the batched "
            "sampler) in the hybridkv column, the same requests decoding freely in the transformers column"
        )
    restart = [name for name, x in s.items() if x.get("baseline") == "full recompute"]
    if restart:
        r = s[restart[0]]
        notes.append(
            f"{', '.join(restart)}: a new disk tier restores {r['restored_tokens']} of the {r['prompt_tokens']} prompt "
            f"tokens from its disk tier ({_mb(r['disk_bytes'])} on disk; cold: page cache dropped) in the hybridkv "
            "column; hybridkv computing the whole prompt, as a restart without a disk tier does, in the other"
        )
    notes.append(f"run: {run['seconds']:.0f} s{' (--quick)' if run['quick'] else ''}")
    for line in notes:
        console.print(line, highlight=False)
