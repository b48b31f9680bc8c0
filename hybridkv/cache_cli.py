"""`hybridkv cache ls|clear [--cache-dir DIR]`: what the prefix cache keeps on disk, and deleting it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    cache = commands.add_parser(
        "cache",
        help="list or clear the prefix cache kept on disk",
        description="The prefix cache's disk tier (run and serve keep one by default): K/V blocks and recurrent "
        "states of past prompts and answers, per model. `ls` lists it, `clear` deletes it.",
    )
    cache.add_argument("action", choices=["ls", "clear"], help="ls: list per model; clear: delete every cached file")
    cache.add_argument("--cache-dir", metavar="DIR", help="the directory (default: the one run and serve use)")
    cache.set_defaults(run=cache_command)


def cache_command(args: argparse.Namespace) -> int:
    from hybridkv.engine.disk_store import clear, default_cache_dir, list_models
    from hybridkv.models.weights import format_bytes

    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.action == "clear":
        freed = clear(root)
        print(f"cleared {root}: {format_bytes(freed)} freed", file=sys.stderr)
        return 0
    rows = list_models(root)
    print(f"{root}: {format_bytes(sum(r['bytes'] for r in rows))} in {len(rows)} model(s)")
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"])) if r["last_used"] else "never"
        print(
            f"  {r['key'][:12]}  {r['model']}  {r['blocks']} blocks, {r['states']} states, "
            f"{format_bytes(r['bytes'])}, last used {used}"
        )
    return 0
