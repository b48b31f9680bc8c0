"""Running the app on uvicorn, with a shutdown that ends streams properly.

`serve` takes a socket bound beforehand (`bind`, before the model loads: a busy port fails at
once, in one line) and announces the address once uvicorn listens on it.

Shutdown (Ctrl-C, SIGTERM): no new connections are accepted; streams in flight get `grace`
seconds to finish, then their requests are cancelled so that each stream still ends with its
final chunk (finish reason "abort" / done reason "cancelled"); then the engine stops.

A server is never opened beyond loopback by accident: `make_server` refuses a host that resolves
to any other address unless API keys are set or `Access.allow_unauthenticated` says it is meant.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from hybridkv.engine.llm import LLM
from hybridkv.server.app import create_app
from hybridkv.server.auth import Access
from hybridkv.server.kv_events import KvEvents

log = logging.getLogger("hybridkv.server")


class PortUnavailable(OSError):
    """The address cannot be bound (in use, not this machine's, not permitted); one line naming it."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (port 0: a free one), not yet listening."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise PortUnavailable(f"--host {host}: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart past TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "already in use (another server?); stop it or choose another --port"
        elif e.errno == errno.EACCES:
            why = "not permitted (ports below 1024 need privileges); choose another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "not an address of this machine; check --host"
        else:
            why = e.strerror or str(e)
        raise PortUnavailable(f"cannot listen on {url(host, port)}: {why}") from None
    return sock


def url(host: str, port: int, scheme: str = "http") -> str:
    """scheme://host:port, an IPv6 host in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """A uvicorn server that calls `cancel_all` `grace` seconds into its shutdown, before uvicorn
    (5 s later) would cut the connections still open; `announce(address)` runs once it listens."""

    def __init__(
        self,
        config: uvicorn.Config,
        cancel_all: Callable[[], None],
        grace: float,
        announce: Callable[[tuple[str, int]], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.cancel_all = cancel_all
        self.grace = grace
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.announce is not None:
            self.announce(self.servers[0].sockets[0].getsockname()[:2])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        handle = asyncio.get_running_loop().call_later(self.grace, self._cancel)
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()

    def _cancel(self) -> None:
        log.warning("shutting down: cancelling the requests still running after %.1f s", self.grace)
        self.cancel_all()


def make_server(
    llm: LLM,
    model_id: str,
    host: str,
    port: int,
    grace: float = 5.0,
    access: Access | None = None,
    announce: Callable[[tuple[str, int]], None] | None = None,
    kv_events: KvEvents | None = None,
    **uvicorn_options: Any,
) -> GracefulServer:
    """The server, not started. `uvicorn_options` go to `uvicorn.Config` (`ssl_certfile`,
    `ssl_keyfile`, `log_level`, ...). Raises `AccessError` for a host beyond loopback that
    `access` does not cover."""
    access = access or Access()
    access.check_host(host, port)
    app = create_app(llm, model_id, access=access, kv_events=kv_events)
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="on", timeout_graceful_shutdown=int(grace) + 5, **uvicorn_options
    )
    return GracefulServer(config, app.state.server.cancel_all, grace, announce)


def serve(
    llm: LLM,
    model_id: str,
    sock: socket.socket,
    grace: float = 5.0,
    access: Access | None = None,
    kv_events: KvEvents | None = None,
    **tls: Any,
) -> None:
    """Serve on the bound socket `sock` until interrupted; the address is printed once it listens.
    `kv_events`: a bound publisher for the prefix cache's blocks. `tls`: uvicorn's `ssl_certfile`
    and `ssl_keyfile`."""
    access = access or Access()
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls.get("ssl_certfile") else "http"
    keys = f", {len(access.keys)} API key{'s' if len(access.keys) != 1 else ''}" if access.keys else ""

    def announce(address: tuple[str, int]) -> None:
        where = url(*address, scheme=scheme)
        print(f"hybridkv: serving {llm.source.description} as model {model_id!r} on {where}{keys}", file=sys.stderr)

    make_server(llm, model_id, host, port, grace, access, announce, kv_events, **tls).run(sockets=[sock])
