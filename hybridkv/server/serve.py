"""Running the app on uvicorn, with a shutdown that ends streams properly.

Shutdown (Ctrl-C, SIGTERM): no new connections are accepted; streams in flight get `grace`
seconds to finish, then their requests are cancelled so that each stream still ends with its
final chunk (finish reason "abort" / done reason "cancelled"); then the engine stops.

A server is never opened beyond loopback by accident: `make_server` refuses a host that resolves
to any other address unless API keys are set or `Access.allow_unauthenticated` says it is meant.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from hybridkv.engine.llm import LLM
from hybridkv.server.app import create_app
from hybridkv.server.auth import Access

log = logging.getLogger("hybridkv.server")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that calls `cancel_all` `grace` seconds into its shutdown, before uvicorn
    (5 s later) would cut the connections still open."""

    def __init__(self, config: uvicorn.Config, cancel_all: Callable[[], None], grace: float) -> None:
        super().__init__(config)
        self.cancel_all = cancel_all
        self.grace = grace

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
    **uvicorn_options: Any,
) -> GracefulServer:
    """The server, not started. `uvicorn_options` go to `uvicorn.Config` (`ssl_certfile`,
    `ssl_keyfile`, `log_level`, ...). Raises `AccessError` for a host beyond loopback that
    `access` does not cover."""
    access = access or Access()
    access.check_host(host, port)
    app = create_app(llm, model_id, access=access)
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="on", timeout_graceful_shutdown=int(grace) + 5, **uvicorn_options
    )
    return GracefulServer(config, app.state.server.cancel_all, grace)


def serve(
    llm: LLM, model_id: str, host: str, port: int, grace: float = 5.0, access: Access | None = None, **tls: Any
) -> None:
    """Serve until interrupted. `tls`: uvicorn's `ssl_certfile` and `ssl_keyfile`."""
    access = access or Access()
    server = make_server(llm, model_id, host, port, grace, access, **tls)
    scheme = "https" if tls.get("ssl_certfile") else "http"
    keys = f", {len(access.keys)} API key{'s' if len(access.keys) != 1 else ''}" if access.keys else ""
    where = f"[{host}]" if ":" in host else host
    print(
        f"hybridkv: serving {llm.source.description} as model {model_id!r} on {scheme}://{where}:{port}{keys}",
        file=sys.stderr,
    )
    server.run()
