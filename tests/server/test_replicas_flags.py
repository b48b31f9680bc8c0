"""What `serve --replicas` refuses before anything starts, each in one line naming the flag: a
router that cannot carry the keys or TLS asked for, a policy the router lacks, flags serve sets
itself. And --help names the default router and policy."""

from __future__ import annotations

import argparse
import http.server
import subprocess
import sys
import threading

import pytest

from hybridkv.cli import main
from hybridkv.server import replicas

NO_MODEL = "/nonexistent/model"  # a refusal must come before the model would be looked for


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_API_KEY", raising=False)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--api-key", "k1", "--api-key", "k2"], "--router sglang takes one API key"),
        (["--router", "vllm", "--host", "0.0.0.0", "--api-key", "k1"], "--router vllm listens on loopback only"),
        (["--policy", "kv_aware"], "--policy kv_aware: --router sglang takes"),
        (["--router", "vllm", "--policy", "manual"], "--policy manual"),
        (["--kv-events", "tcp://127.0.0.1:5557"], "--kv-events"),
        (["--threads", "1"], "--threads 1 cannot be split between 2 replicas"),
        (["--host", "0.0.0.0"], "--allow-unauthenticated"),
        (["--port", "0"], "--port 0 with --replicas"),
    ],
)
def test_refused_before_anything_starts(capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    pytest.importorskip("sglang_router", reason="the [cluster] extra is not installed")
    assert main(["serve", "--replicas", "2", "--model", NO_MODEL, *flags]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0] and "not found" not in errors[0]


def test_tls_with_vllm_is_refused() -> None:
    """(Through main, the certificate files would be checked first: the check itself here.)"""
    import argparse

    from hybridkv.cli import UsageError
    from hybridkv.server.auth import Access
    from hybridkv.server.replicas import check_cluster_flags

    args = argparse.Namespace(
        replicas=2, router="vllm", policy=None, kv_events=None, threads=None, ssl_certfile="c.pem", host="127.0.0.1"
    )
    args.port = 8000
    with pytest.raises(UsageError, match="--router vllm cannot serve TLS"):
        check_cluster_flags(args, Access())


def test_help_names_the_default_router_and_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default sglang" in text and "cache_aware for sglang" in text and "kv_aware for vllm" in text


@pytest.mark.parametrize(
    ("endpoint", "named"),
    [("tcp://0.0.0.0:5557", "--kv-events 0.0.0.0 is reachable beyond"), ("udp://x", "give tcp://HOST:PORT")],
)
def test_a_kv_event_endpoint_is_checked_as_a_listener(
    capsys: pytest.CaptureFixture[str], endpoint: str, named: str
) -> None:
    """The publisher is a listener too: beyond loopback it needs a key (or --allow-unauthenticated)."""
    assert main(["serve", "--kv-events", endpoint, "--model", NO_MODEL]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0]


@pytest.mark.parametrize("router", ["sglang", "vllm"])
def test_a_router_key_starting_with_a_dash_reaches_the_router(monkeypatch: pytest.MonkeyPatch, router: str) -> None:
    """The router's command line runs a shim that adds the key from the environment; argparse
    would read a key starting with "-" as another flag (`secrets.token_urlsafe` gives one in 64)."""
    import argparse
    import importlib
    import sys

    from hybridkv.server.replicas import _ROUTER_KEY_ENV, ROUTERS, router_command

    launcher = pytest.importorskip(f"{ROUTERS[router].package}.launch_router")
    args = argparse.Namespace(router=router, host="127.0.0.1", port=8000, policy="round_robin", ssl_certfile=None)
    worker = argparse.Namespace(url="http://127.0.0.1:9001", kv_port=None)
    command = router_command(args, [worker], "m", 9100)
    parsed = []
    monkeypatch.setattr(launcher, "main", lambda: parsed.append(launcher.parse_router_args(sys.argv[1:])))
    monkeypatch.setenv(_ROUTER_KEY_ENV, "-starts-with-a-dash")
    monkeypatch.setattr(sys, "argv", ["-c", *command[3:]])
    assert command[1] == "-c" and importlib.import_module(launcher.__name__) is launcher
    exec(command[2], {})
    assert parsed and parsed[0].api_key == "-starts-with-a-dash"


class _Readiness(http.server.BaseHTTPRequestHandler):
    """A stand-in sglang-router: /readiness 503 until `ready_after` requests have come in."""

    seen: list[str] = []
    ready_after = 3

    def do_GET(self) -> None:
        _Readiness.seen.append(self.path)
        code = 200 if len(_Readiness.seen) > _Readiness.ready_after else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_serve_announces_sglang_only_once_it_routes() -> None:
    """sglang-router listens before it has added the workers and answers 503 meanwhile (a cluster
    test's first request met that): serve waits for its /readiness, and a router that exits while
    starting is an error, not a wait."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = argparse.Namespace(host="127.0.0.1", port=server.server_address[1], ssl_certfile=None)
    router = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _Readiness.seen.clear()
        replicas._wait_ready(args, router, timeout=30)
        assert _Readiness.seen == ["/readiness"] * 4  # returned on the first 200, not before
    finally:
        router.kill()
        router.wait()
        server.shutdown()
    with pytest.raises(RuntimeError, match="exited with status"):
        replicas._wait_ready(args, router, timeout=30)
