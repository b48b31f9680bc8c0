"""`hybridkv quantize IN OUT.gguf --type TYPE`: a safetensors checkpoint written once as a GGUF
file in llama.cpp's layout (`models.gguf_writer`), which hybridkv, llama.cpp and ollama load.

IN is what `--model` takes that resolves to a checkpoint directory (a path, or a Hugging Face
repo id in the local cache); `--type` is one of `models.gguf_recipe.FILE_TYPES`. stderr gets one
line per tensor type and the file's size; OUT appears only once complete.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hybridkv.errors import NotSupported
from hybridkv.models.gguf_recipe import FILE_TYPES


def add_parser(commands: Any) -> None:
    """Register `quantize` on the CLI's subparsers (the writer is imported when it runs)."""
    quantize = commands.add_parser(
        "quantize",
        help="write a checkpoint as a GGUF file (q8_0, q4_k_m, ...)",
        description="Write a safetensors checkpoint once as a GGUF file in llama.cpp's layout, quantized "
        "by llama.cpp's rules for the file type (its fallback types where rows do not fit the blocks).",
    )
    quantize.add_argument("input", metavar="IN", help="a checkpoint directory (or a Hugging Face repo id, cached)")
    quantize.add_argument("output", metavar="OUT.gguf", help="the GGUF file to write")
    quantize.add_argument(
        "--type",
        default="q8_0",
        type=str.lower,
        choices=list(FILE_TYPES),
        help="file type (default q8_0): q4_k_m and q6_k are llama.cpp's mixtures, q4_k every tensor Q4_K",
    )
    quantize.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridkv import cli

    try:
        return _write(args)
    except (ValueError, NotSupported, FileNotFoundError) as e:  # a bad input: one line, status 2
        return cli._fail(str(e))


def _write(args: argparse.Namespace) -> int:
    from hybridkv.models.gguf_writer import write_quantized
    from hybridkv.models.sources import resolve_model

    source = resolve_model(args.input)
    if source.is_gguf:
        raise ValueError(f"{args.input} is already a GGUF file; `hybridkv quantize` reads safetensors checkpoints")
    out = Path(args.output)
    if out.suffix != ".gguf":
        raise ValueError(f"{out}: the output must be a .gguf file")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent}: no such directory for the output file")
    start = time.perf_counter()
    written = write_quantized(source.path, out, args.type)
    for type_name, count in sorted(Counter(t.type_name for t in written).items()):
        print(f"  {type_name:5s} {count} tensors", file=sys.stderr)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 1e6:.1f} MB, {args.type}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
