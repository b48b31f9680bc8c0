"""`hybridkv serve [--host H] [--port P] [--max-queue N] [engine flags]`: the command line of the server."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_MODEL_ID = "hybridkv-default"


def add_parser(commands: Any) -> None:
    """Register `serve` on the CLI's subparsers; uvicorn and the model load when it runs."""
    from hybridkv.cli import add_engine_flags

    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI- and Ollama-compatible APIs)",
        description="Serve a model over HTTP: OpenAI-compatible /v1/completions, /v1/chat/completions and "
        "/v1/models; Ollama-compatible /api/generate, /api/chat, /api/tags, /api/show, /api/ps, "
        "/api/version; /health and /metrics (Prometheus).",
    )
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one, shown when serving)"
    )
    serve.add_argument(
        "--max-queue", type=int, default=256, metavar="N", help="requests waiting at most; beyond, 429 (default 256)"
    )
    serve.add_argument(
        "--model-id",
        metavar="NAME",
        help="the model's name in the APIs (default: the directory's name, the ollama name or the repo id)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds streams may take to finish on shutdown before they are cancelled (default 5)",
    )
    serve.set_defaults(run=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    from hybridkv import cli
    from hybridkv.server.serve import PortUnavailable, bind, serve

    try:
        _check(args)
        sock = bind(args.host, args.port)  # before the model loads: a busy port fails at once
    except (cli.UsageError, PortUnavailable) as e:  # here too: under `python -m hybridkv.cli`, cli.main's class differs
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    with sock:
        try:
            llm = cli.llm_from_args(args)
        except cli.UsageError as e:
            print(f"hybridkv: error: {e}", file=sys.stderr)
            return 2
        model_id = args.model_id or (llm.source.served_name if args.model else DEFAULT_MODEL_ID)
        serve(llm, model_id, sock, args.shutdown_timeout)
    return 0


def _check(args: argparse.Namespace) -> None:
    from hybridkv.cli import UsageError

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise UsageError("--max-queue must be >= 1")
    if args.shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout must be >= 0")
