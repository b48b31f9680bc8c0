"""`hybridkv serve [--host H] [--port P] [--max-queue N] [access flags] [engine flags]`: the command
line of the server. Everything it can refuse (flags, key sources, TLS files, a host beyond loopback
without a key) is refused before the model loads."""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL_ID = "hybridkv-default"


def add_parser(commands: Any) -> None:
    """Register `serve` on the CLI's subparsers; uvicorn and the model load when it runs."""
    from hybridkv.cli import add_disk_flags, add_engine_flags
    from hybridkv.server.replicas import add_cluster_flags

    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI- and Ollama-compatible APIs)",
        description="Serve a model over HTTP: OpenAI-compatible /v1/completions, /v1/chat/completions and "
        "/v1/models; Ollama-compatible /api/generate, /api/chat, /api/tags, /api/show, /api/ps, "
        "/api/version; /health and /metrics (Prometheus).",
    )
    add_engine_flags(serve)
    add_disk_flags(serve)
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
    serve.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish the prefix cache's blocks on this ZMQ endpoint (tcp://127.0.0.1:5557) for vllm-router's "
        "kv_aware policy (needs the [cluster] extra)",
    )
    # A worker of `serve --replicas` (internal): load, then serve the inherited socket stdin names.
    serve.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    # Also internal: the worker's share of the machine's memory (`MemoryShare`), from `serve --replicas`.
    serve.add_argument("--memory-share", type=_memory_share, help=argparse.SUPPRESS)
    _add_access_flags(serve)
    add_cluster_flags(serve)
    serve.set_defaults(run=serve_command)


def _add_access_flags(serve: argparse.ArgumentParser) -> None:
    access = serve.add_argument_group(
        "access",
        "API keys: with any, every route but /health, GET /, /api/version (and /metrics with --metrics-public) "
        "needs 'Authorization: Bearer KEY'. Keys from all three sources are accepted; prefer the file or "
        "HYBRIDKV_API_KEY (comma-separated), since arguments show in `ps`. Without a key, serve refuses a "
        "--host that reaches beyond loopback (127.0.0.0/8, ::1).",
    )
    access.add_argument(
        "--api-key-file", metavar="FILE", help="a file of API keys, one a line (blank lines and # comments skipped)"
    )
    access.add_argument(
        "--api-key", action="append", metavar="KEY", help="an API key (repeatable; visible to other users in `ps`)"
    )
    access.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without API keys: anyone who reaches the port may use the model",
    )
    access.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    access.add_argument(
        "--max-waiting-per-key",
        type=int,
        metavar="N",
        help="requests one API key may have waiting in the queue; beyond, 429 for that key only (default: no limit)",
    )
    access.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    access.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM, unencrypted)")


def _memory_share(text: str) -> Any:
    from hybridkv.models.weights import MemoryShare

    try:
        return MemoryShare.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_command(args: argparse.Namespace) -> int:
    from hybridkv import cli
    from hybridkv.server.serve import PortUnavailable, bind, serve

    try:
        access = _check(args)  # flags, keys, TLS files, the loopback rule: before anything loads
        if args.standby:
            return _serve_when_told(args, access)
        sock = bind(args.host, args.port)  # before the model loads: a busy port fails at once
    except (cli.UsageError, PortUnavailable) as e:  # here too: under `python -m hybridkv.cli`, cli.main's class differs
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    if args.replicas is not None:
        sock.close()  # the router listens there; serve_replicas binds it again once the workers are up
        from hybridkv.server.replicas import serve_replicas

        return serve_replicas(args, access)
    with sock:
        try:
            kv_events = _kv_events(args.kv_events)
            llm = cli.llm_from_args(args)
        except cli.UsageError as e:
            print(f"hybridkv: error: {e}", file=sys.stderr)
            return 2
        model_id = args.model_id or (llm.source.served_name if args.model else DEFAULT_MODEL_ID)
        tls = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}
        serve(llm, model_id, sock, args.shutdown_timeout, access, kv_events, **tls)
    return 0


def _serve_when_told(args: argparse.Namespace, access: Any) -> int:
    """A worker of `serve --replicas`: load the model, then wait for one JSON line on stdin saying
    which inherited listening socket to serve, with how many threads, on which CPUs, publishing KV
    events where. A spare loaded ahead of need so takes a dead worker's place at once."""
    from hybridkv import cli
    from hybridkv.server.serve import serve

    try:
        llm = cli.llm_from_args(args)
    except cli.UsageError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    line = sys.stdin.readline()
    if not line:
        return 0  # never needed: serve --replicas is stopping
    role = json.loads(line)
    for fd in role.get("close", ()):  # the other workers' sockets, inherited for a spare's sake
        os.close(fd)
    if role.get("cpus"):  # memory follows: the kernel allocates on the node of the CPU that first touches it
        os.sched_setaffinity(0, role["cpus"])
    import torch

    torch.set_num_threads(role["threads"])
    try:
        kv_events = _kv_events(role.get("kv_events"))
    except cli.UsageError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    model_id = args.model_id or (llm.source.served_name if args.model else DEFAULT_MODEL_ID)
    serve(llm, model_id, socket.socket(fileno=role["fd"]), args.shutdown_timeout, access, kv_events)
    return 0


def _kv_events(endpoint: str | None) -> Any:
    """The KV event publisher, bound before the model loads (a busy port fails at once)."""
    from hybridkv.cli import UsageError

    if endpoint is None:
        return None
    try:
        from hybridkv.server.kv_events import KvEvents

        return KvEvents(endpoint)
    except ImportError as e:
        raise UsageError(f"--kv-events needs pyzmq and msgpack: pip install 'hybridkv[cluster]' ({e})") from None
    except OSError as e:
        raise UsageError(str(e)) from None


def _check(args: argparse.Namespace) -> Any:
    """Every flag the server can refuse, checked; the `Access` they ask for."""
    from hybridkv.cli import UsageError
    from hybridkv.server.auth import AccessError

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise UsageError("--max-queue must be >= 1")
    if args.shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout must be >= 0")
    try:
        socket.getaddrinfo(args.host, args.port)
    except OSError as e:
        raise UsageError(f"--host {args.host}: {e}") from None
    try:
        access = _access(args)
    except AccessError as e:
        raise UsageError(str(e)) from None
    _check_tls(args.ssl_certfile, args.ssl_keyfile)
    if args.kv_events is not None:
        _check_kv_events(args.kv_events, access)
    if args.replicas is not None:
        from hybridkv.server.replicas import check_cluster_flags

        check_cluster_flags(args, access)
    return access


def _check_kv_events(endpoint: str, access: Any) -> None:
    """A tcp://HOST:PORT endpoint; beyond loopback only as the HTTP port would be (keys or
    --allow-unauthenticated), and with a warning: events are not authenticated."""
    from hybridkv.cli import UsageError
    from hybridkv.server.auth import AccessError, exposed_addresses

    scheme, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if scheme not in ("tcp", "ipc") or (scheme == "tcp" and not (host and port.isdigit())):
        raise UsageError(f"--kv-events {endpoint}: give tcp://HOST:PORT (or ipc://PATH)")
    if scheme == "tcp":
        try:
            access.check_host(host, int(port))
        except AccessError as e:
            raise UsageError(str(e).replace("--host", "--kv-events", 1)) from None
        if exposed_addresses(host, int(port)):
            _warn(f"--kv-events {endpoint}: the events (prompt token ids) are not authenticated: keep them private")


def _access(args: argparse.Namespace) -> Any:
    """The keys and limits the flags and HYBRIDKV_API_KEY ask for, checked against --host."""
    from hybridkv.server.auth import ENV_VAR, ROUTER_KEY_VAR, Access, exposed_addresses, load_keys

    keys = load_keys(args.api_key or (), args.api_key_file, os.environ.get(ENV_VAR))
    router_key = os.environ.get(ROUTER_KEY_VAR)  # set by `serve --replicas` for its workers only
    access = Access(keys, args.metrics_public, args.max_waiting_per_key, args.allow_unauthenticated, router_key)
    access.check_host(args.host, args.port)
    if args.api_key_file and Path(args.api_key_file).stat().st_mode & 0o077:
        _warn(f"--api-key-file {args.api_key_file} can be read by other users (chmod 600 it)")
    if keys and not args.ssl_certfile and exposed_addresses(args.host, args.port):
        _warn("API keys cross the network in clear text over http: add --ssl-certfile/--ssl-keyfile or a TLS proxy")
    return access


def _check_tls(certfile: str | None, keyfile: str | None) -> None:
    """The certificate and key load (uvicorn would fail on them only after the model loaded)."""
    from hybridkv.cli import UsageError

    if certfile is None:
        if keyfile is not None:
            raise UsageError("--ssl-keyfile needs --ssl-certfile")
        return
    flags = f"--ssl-certfile {certfile}" + (f" --ssl-keyfile {keyfile}" if keyfile else "")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password="")
    except ssl.SSLError as e:  # (an OSError too)
        what = "a PEM certificate and its unencrypted private key" + ("" if keyfile else " (or give --ssl-keyfile)")
        raise UsageError(f"{flags}: not {what}: {e.reason or e}") from None
    except OSError as e:
        raise UsageError(f"{flags}: {e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None


def _warn(message: str) -> None:
    print(f"hybridkv: warning: {message}", file=sys.stderr)
