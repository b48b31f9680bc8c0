"""`hybridkv serve --replicas N`: N engine workers on loopback behind a cache-aware router
(sglang-router or vllm-router, from the `[cluster]` extra), as one process tree.

    client ─▶ router (--host:--port, metrics on 127.0.0.1:free) ─┬─▶ worker 0 (127.0.0.1:free)
                                                                 └─▶ worker 1 (127.0.0.1:free) ...

Workers are `hybridkv serve` processes, started with the same engine flags; `--threads` and
`--cache-memory` are split evenly between them. Without `--cache-memory` each sizes its default
cache in an equal share of the memory `serve` reads once before any of them loads (`MemoryShare`:
the weights counted once per worker and once for the spare), so together they fit as one process
would. On a machine with several NUMA nodes each worker is pinned to one node's CPUs (`placement`).
The router starts once every worker answers /health; `serve` announces the cluster once the router
listens (sglang-router: once its /readiness reports the workers). `serve` binds the workers'
sockets itself and keeps a spare worker loaded: when a worker dies, the spare takes over its
socket (requests meanwhile wait in the backlog) and the router's health checks (every second)
take it back; a new spare loads (with `--no-spare`, the dead worker is started again instead).
The children die with `serve` (PR_SET_PDEATHSIG), and stop when it stops.

Keys (see README, "Serving on a network"): sglang-router checks clients itself with its one
`--api-key` and sends it on to the workers, which take it; vllm-router checks nobody and forwards
the client's key on /v1, so its workers check the user's keys, and accept its own key only on the
`/tokenize` probes (`auth.ROUTER_PATHS`). Keys never go on a command line: they pass in the
environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.server.auth import ENV_VAR, ROUTER_KEY_VAR, Access

HEALTH_INTERVAL_S = 1  # the router's checks: a restarted worker is back within a second of being up
_ROUTER_KEY_ENV = "HYBRIDKV_ROUTER_API_KEY"  # the router's --api-key, read by the shim below


@dataclasses.dataclass(frozen=True)
class RouterKind:
    package: str  # the Python module of its launcher
    policies: tuple[str, ...]
    default_policy: str


ROUTERS = {
    "sglang": RouterKind("sglang_router", ("cache_aware", "round_robin", "random", "power_of_two"), "cache_aware"),
    "vllm": RouterKind(
        "vllm_router",
        ("kv_aware", "cache_aware", "round_robin", "random", "power_of_two", "consistent_hash"),
        "kv_aware",
    ),
}
DEFAULT_ROUTER = "sglang"


def add_cluster_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "replicas",
        "Several engine processes behind a cache-aware router, on --host:--port (needs the [cluster] extra). "
        "Cluster-wide counts: the router's Prometheus metrics, on a free loopback port printed at start.",
    )
    group.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="run N workers on loopback ports behind a router (default: one process)",
    )
    group.add_argument(
        "--no-spare",
        dest="standby_spare",
        action="store_false",
        help="keep no loaded spare worker (by default one waits, so a dead worker is replaced at once; it costs one "
        "more copy of the model in memory): a dead worker is then restarted, as long as a load takes",
    )
    group.add_argument(
        "--router",
        choices=sorted(ROUTERS),
        default=DEFAULT_ROUTER,
        help=f"the router in front of the replicas (default {DEFAULT_ROUTER}: sglang-router, which checks the API key "
        "and serves TLS; vllm: vllm-router, loopback only, with kv_aware routing on the workers' real cache)",
    )
    group.add_argument(
        "--policy",
        help="the router's policy (default: "
        + ", ".join(f"{kind.default_policy} for {name}" for name, kind in ROUTERS.items())
        + "; sglang: "
        + ", ".join(ROUTERS["sglang"].policies)
        + "; vllm: "
        + ", ".join(ROUTERS["vllm"].policies)
        + ")",
    )


def check_cluster_flags(args: argparse.Namespace, access: Access) -> None:
    """Everything `--replicas` can refuse, before anything starts."""
    from hybridkv.cli import UsageError

    kind = ROUTERS[args.router]
    if args.replicas < 1:
        raise UsageError("--replicas must be >= 1")
    if args.port == 0:
        raise UsageError("--port 0 with --replicas: give the router a port (its own choice would not be known here)")
    if args.policy is None:
        args.policy = kind.default_policy
    if args.policy not in kind.policies:
        raise UsageError(f"--policy {args.policy}: --router {args.router} takes {', '.join(kind.policies)}")
    if args.kv_events is not None:
        raise UsageError("--kv-events: with --replicas, serve gives each worker its own (with --router vllm)")
    if args.threads is not None and args.threads < args.replicas:
        raise UsageError(
            f"--threads {args.threads} cannot be split between {args.replicas} replicas: give at least one each"
        )
    try:
        __import__(kind.package)
        if args.router == "vllm" and args.policy == "kv_aware":
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
    except ImportError as e:
        raise UsageError(f"--replicas needs the [cluster] extra: pip install 'hybridkv[cluster]' ({e})") from None
    if args.router == "sglang" and len(access.keys) > 1:
        raise UsageError(
            f"--router sglang takes one API key (sglang-router has a single --api-key), got {len(access.keys)}: "
            "give one, or use --router vllm on loopback, whose workers check every key"
        )
    if args.router == "vllm":
        from hybridkv.server.auth import exposed_addresses

        if args.ssl_certfile:
            raise UsageError("--router vllm cannot serve TLS (vllm-router has none): use --router sglang")
        if exposed_addresses(args.host, args.port):
            raise UsageError(
                f"--router vllm listens on loopback only (vllm-router checks no key and has no TLS), not --host "
                f"{args.host}: use --router sglang, or put a TLS proxy that checks keys in front of a loopback router"
            )


# -- placement ---------------------------------------------------------------------------------


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[list[int]]:
    """The CPUs of each NUMA node this process may run on ([] when the kernel shows none)."""
    allowed = os.sched_getaffinity(0)
    nodes = []
    for path in sorted(root.glob("node[0-9]*/cpulist"), key=lambda p: int(p.parent.name[4:])):
        cpus = [c for c in parse_cpulist(path.read_text()) if c in allowed]
        if cpus:
            nodes.append(cpus)
    return nodes


def parse_cpulist(text: str) -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus += range(int(low), int(high or low) + 1)
    return cpus


def placement(replicas: int, nodes: Sequence[Sequence[int]]) -> list[tuple[int, list[int]] | None]:
    """Per replica, (NUMA node, the CPUs it is pinned to), or None with fewer than two nodes
    (nothing to gain: the kernel's own scheduling is as good). Replicas go round the nodes; the
    replicas sharing a node split its CPUs (all of them, when there are more replicas than CPUs)."""
    if len(nodes) < 2:
        return [None] * replicas
    out: list[tuple[int, list[int]] | None] = []
    for r in range(replicas):
        node = r % len(nodes)
        sharing = len(range(node, replicas, len(nodes)))  # replicas on this node
        rank = r // len(nodes)
        cpus = list(nodes[node])
        share = len(cpus) // sharing
        out.append((node, cpus[rank * share : (rank + 1) * share] if share else cpus))
    return out


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal shares, larger first: split(5, 2) == [3, 2]."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when `serve` dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclasses.dataclass
class Worker:
    """One replica's place: its listening socket (bound here, so it outlives its processes: a
    request arriving while the process is replaced waits in the backlog), its role, its process."""

    index: int
    sock: socket.socket
    role: dict[str, Any]  # what the process is told to serve: {"fd", "threads", "cpus", "kv_events"}
    kv_port: int | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Spawner:
    """Starts worker processes: `hybridkv serve --standby`, which loads the model, then reads its
    role (which inherited socket to serve, threads, CPUs, KV-event endpoint) as one JSON line on
    stdin. A spare started ahead of need takes a dead worker's place as soon as it is told to."""

    def __init__(self, command: list[str], env: dict[str, str], workers: Sequence[Worker]) -> None:
        self.command = command
        self.env = env
        self.fds = tuple(w.sock.fileno() for w in workers)

    def spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.command, env=self.env, stdin=subprocess.PIPE, pass_fds=self.fds, preexec_fn=_die_with_parent
        )

    def assign(self, process: subprocess.Popen[bytes], worker: Worker) -> None:
        """Tell `process` to serve as `worker` (and to close the other workers' sockets)."""
        assert process.stdin is not None
        role = {**worker.role, "close": [fd for fd in self.fds if fd != worker.sock.fileno()]}
        with contextlib.suppress(BrokenPipeError):  # it died meanwhile: the watch loop sees it
            process.stdin.write(json.dumps(role).encode() + b"\n")
            process.stdin.close()
        worker.process = process


def plan_workers(args: argparse.Namespace, access: Access, router_key: str | None) -> tuple[list[Worker], Spawner]:
    """The workers' sockets (free loopback ports) and roles, and how to start their processes:
    `hybridkv serve` with the engine flags passed through, threads and cache memory split."""
    from hybridkv.server.serve import bind

    n = args.replicas
    cores = args.threads or len(os.sched_getaffinity(0))
    threads = split(max(cores, n), n)
    places = placement(n, numa_nodes())
    workers = []
    for i in range(n):
        sock = bind("127.0.0.1", 0)
        sock.set_inheritable(True)
        place = places[i]
        role: dict[str, Any] = {"fd": sock.fileno(), "threads": threads[i], "cpus": place[1] if place else None}
        kv_port = None
        if args.router == "vllm" and args.policy == "kv_aware":
            kv_port = free_port()
            role["kv_events"] = f"tcp://127.0.0.1:{kv_port}"
        workers.append(Worker(i, sock, role, kv_port))
    passed = [
        ("--dtype", args.dtype),
        ("--max-model-len", args.max_model_len),
        ("--snapshot-interval", args.snapshot_interval),
        ("--kv-dtype", args.kv_dtype),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-queue", args.max_queue),
        ("--shutdown-timeout", args.shutdown_timeout),
        ("--model", args.model),
        ("--quantize", args.quantize),
        ("--model-id", args.model_id),
        ("--max-waiting-per-key", args.max_waiting_per_key),
        ("--threads", threads[0]),  # while loading; the role sets the worker's own share
    ]
    if args.cache_memory:
        from hybridkv.cli import parse_size

        passed.append(("--cache-memory", parse_size(args.cache_memory) // n))
    # Read here, once, before any worker loads: each plans its weights and cache in the same share.
    from hybridkv.models.weights import MemoryShare, available_memory

    passed.append(("--memory-share", str(MemoryShare(available_memory(), n + bool(args.standby_spare), n))))
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--standby", "--host", "127.0.0.1"]
    command += [item for flag, value in passed if value is not None for item in (flag, str(value))]
    if args.metrics_public:
        command.append("--metrics-public")
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, ROUTER_KEY_VAR)}
    if access.keys:
        env[ENV_VAR] = ",".join(sorted(access.keys))
        if router_key is not None:
            env[ROUTER_KEY_VAR] = router_key
    return workers, Spawner(command, env, workers)


def router_command(args: argparse.Namespace, workers: Sequence[Worker], model_id: str, metrics_port: int) -> list[str]:
    """The router's command line, every flag that matters set explicitly."""
    kind = ROUTERS[args.router]
    # The key comes from the environment, so it is not in the router's command line (`ps`); joined
    # to its flag by "=", since a key may start with "-" (a random one does, 1 in 64).
    shim = (
        f"import os, sys; key = os.environ.pop({_ROUTER_KEY_ENV!r}, None); "
        f"sys.argv[1:] += ['--api-key=' + key] if key else []; from {kind.package}.launch_router import main; main()"
    )
    command = [sys.executable, "-c", shim, "--host", args.host, "--port", str(args.port)]
    command += ["--worker-urls", *(w.url for w in workers), "--policy", args.policy]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    # A failed request is tried once more (on a live worker: a dead one fails its health check
    # within a second); a 429 is not retried across every worker.
    command += ["--retry-max-retries", "2", "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000"]
    command += ["--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-check-timeout-secs", "2"]
    command += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
    command += ["--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "2"]
    command += ["--log-level", "warn" if args.router == "sglang" else "warning"]
    if args.router == "sglang":
        command += ["--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1"]
        if args.ssl_certfile:
            command += ["--tls-cert-path", args.ssl_certfile, "--tls-key-path", args.ssl_keyfile or args.ssl_certfile]
    elif args.policy == "kv_aware":
        for w in workers:
            command += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{w.kv_port}"]
        command += ["--kv-event-model", model_id, "--kv-event-block-size", "16"]
    return command


def wait_healthy(workers: Sequence[Worker], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        for w in list(pending):
            if not w.alive():
                code = w.process.returncode if w.process else None
                raise RuntimeError(f"replica {w.index} exited with status {code} while starting (its log is above)")
            try:
                if httpx.get(f"{w.url}/health", timeout=2).status_code == 200:
                    pending.remove(w)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {[w.index for w in pending]} did not answer /health within {timeout:.0f} s")
        time.sleep(0.2)


def serve_replicas(args: argparse.Namespace, access: Access) -> int:
    """Start the workers, then the router once they are healthy; keep the workers alive; stop all
    on SIGINT/SIGTERM or when the router exits. The exit status: 0 on a signal, else the router's."""
    from hybridkv.server.cli import DEFAULT_MODEL_ID

    model_id = args.model_id or DEFAULT_MODEL_ID
    if args.model and not args.model_id:
        from hybridkv.models.sources import resolve_model

        model_id = resolve_model(args.model).served_name
        args.model_id = model_id  # the same name on every worker and in the router's events
    router_key = secrets.token_urlsafe(24) if access.keys and args.router == "vllm" else None
    workers, spawner = plan_workers(args, access, router_key)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    router: subprocess.Popen[bytes] | None = None
    spare: subprocess.Popen[bytes] | None = None
    try:
        for w in workers:
            spawner.assign(spawner.spawn(), w)
        wait_healthy(workers, timeout=600)
        spare = spawner.spawn() if args.standby_spare else None
        metrics_port = free_port()
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        if access.keys:
            env[_ROUTER_KEY_ENV] = router_key or next(iter(access.keys))
        command = router_command(args, workers, model_id, metrics_port)
        router = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)
        _wait_listening(args.host, args.port, router)
        if args.router == "sglang":
            _wait_ready(args, router)
        _announce(args, workers, metrics_port)
        while not stopping and router.poll() is None:
            for w in workers:
                if not w.alive() and not stopping:
                    code = w.process.returncode if w.process else None
                    how = "the spare takes its place" if spare is not None else "starting it again"
                    print(f"hybridkv: replica {w.index} exited ({code}): {how}", file=sys.stderr, flush=True)
                    spawner.assign(spare or spawner.spawn(), w)
                    spare = spawner.spawn() if spare is not None else None
            if spare is not None and spare.poll() is not None and not stopping:
                spare = spawner.spawn()  # the spare itself died (out of memory?): another
            time.sleep(0.1)
        return 0 if stopping else (router.returncode or 1)
    except RuntimeError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop([router] if router else [], [*workers], spare)
        for w in workers:
            w.sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait_router(router: subprocess.Popen[bytes], ready: Callable[[], bool], failure: str, timeout: float) -> None:
    """Until `ready()` (polled every 0.1 s); `failure` (an error) past `timeout` seconds, an error
    too if the router exits meanwhile."""
    deadline = time.monotonic() + timeout
    while router.poll() is None:
        if ready():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)
    raise RuntimeError(f"the router exited with status {router.returncode} while starting (its log is above)")


def _wait_listening(host: str, port: int, router: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until the router accepts connections on its port (it exits: an error)."""
    address = _loopback(host)

    def listening() -> bool:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return True
        except OSError:
            return False

    _wait_router(router, listening, f"the router did not listen on {host}:{port} within {timeout:.0f} s", timeout)


def _loopback(host: str) -> str:
    """The address that reaches, from this machine, a server listening on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


def _wait_ready(args: argparse.Namespace, router: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until sglang-router's /readiness answers 200: it listens before it has added the workers
    (it checks them every second), and until then answers every request 503 "no available workers"."""
    import httpx

    from hybridkv.server.serve import url

    readiness = url(_loopback(args.host), args.port, "https" if args.ssl_certfile else "http") + "/readiness"

    def ready() -> bool:
        try:
            # Loopback to our own router: its certificate may not name this address.
            return httpx.get(readiness, timeout=2, verify=False).status_code == 200
        except httpx.TransportError:
            return False

    failure = f"the router did not report its replicas ready within {timeout:.0f} s ({readiness})"
    _wait_router(router, ready, failure, timeout)


def _announce(args: argparse.Namespace, workers: Sequence[Worker], metrics_port: int) -> None:
    from hybridkv.server.serve import url

    where = url(args.host, args.port, "https" if args.ssl_certfile else "http")
    print(
        f"hybridkv: serving on {where} through {args.router}-router (policy {args.policy}), "
        f"{len(workers)} replicas on {', '.join(w.url for w in workers)}; "
        f"cluster metrics on http://127.0.0.1:{metrics_port}/metrics",
        file=sys.stderr,
        flush=True,
    )


def _stop(
    routers: list[subprocess.Popen[bytes]], workers: Sequence[Worker], spare: subprocess.Popen[bytes] | None
) -> None:
    """The router first (no new requests), then the workers (each finishes its streams)."""
    processes = [*routers, *(w.process for w in workers if w.process), *([spare] if spare else [])]
    for process in processes:
        if process.poll() is None:
            process.terminate()
        if process in routers:
            _wait(process, 10)
    for process in processes:
        _wait(process, 30)


def _wait(process: subprocess.Popen[bytes], seconds: float) -> None:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
