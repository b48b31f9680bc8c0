"""API keys: where they come from, the middleware that checks them before any route (or its
body) is reached, and the refusal to listen beyond loopback without one.

A key is never written anywhere: not in a log line, an error message or a repr. Requests are told
apart by the key's index (`api_key(request)`), which is what the per-key queue limit counts by.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridkv.server.fields import error_body

ENV_VAR = "HYBRIDKV_API_KEY"
ROUTER_KEY_VAR = "HYBRIDKV_ROUTER_KEY"  # a worker of `serve --replicas`: its router's own key
# Open without a key: liveness probes, and what ollama clients call before anything else.
PUBLIC = {"/health": None, "/api/version": None, "/": frozenset({"GET", "HEAD"})}  # path -> methods (None: all)
_SCOPE_KEY = "hybridkv.api_key"  # the matched key's index, in the ASGI scope
# What a router's own key may call on a worker (`Access.router_key`): vllm-router's kv_aware probes.
ROUTER_PATHS = frozenset({"/tokenize", "/v1/chat/completions/render", "/v1/completions/render"})


class AccessError(ValueError):
    """A key source, a limit or a listening address that cannot be used; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may use the server. `keys`: with any, every route off `PUBLIC` needs
    `Authorization: Bearer KEY` (`/metrics` too unless `metrics_public`). `max_waiting_per_key`:
    requests one key may have queued, not yet running. `allow_unauthenticated`: listening beyond
    loopback without keys is meant."""

    keys: frozenset[str] = dataclasses.field(default=frozenset(), repr=False)
    metrics_public: bool = False
    max_waiting_per_key: int | None = None
    allow_unauthenticated: bool = False
    router_key: str | None = dataclasses.field(default=None, repr=False)  # valid on ROUTER_PATHS only
    _digests: tuple[bytes, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in self.keys:
            _check_key(key, "an API key")
        limit = self.max_waiting_per_key
        if limit is not None:
            if not isinstance(limit, int) or limit < 1:
                raise AccessError(f"--max-waiting-per-key must be >= 1, got {limit!r}")
            if not self.keys:
                raise AccessError(f"--max-waiting-per-key counts per API key: set keys ({_HOW_TO_SET})")
        object.__setattr__(self, "_digests", tuple(_digest(key.encode()) for key in sorted(self.keys)))

    def match(self, token: bytes) -> int | None:
        """The index of the key `token` is, or None. Compares against every key, in constant time
        (digests of equal length, so not even the token's length shows)."""
        digest, found = _digest(token), None
        for index, key in enumerate(self._digests):
            if hmac.compare_digest(digest, key):
                found = index
        return found

    def is_public(self, method: str, path: str) -> bool:
        if path == "/metrics" and self.metrics_public:
            return True
        if path not in PUBLIC:
            return False
        methods = PUBLIC[path]
        return methods is None or method in methods

    def check_host(self, host: str, port: int) -> None:
        """Refuse to listen beyond loopback without keys (unless that is allowed)."""
        if self.keys or self.allow_unauthenticated:
            return
        exposed = exposed_addresses(host, port)
        if exposed:
            where = host if exposed == [host] else f"{host} ({', '.join(exposed)})"
            raise AccessError(
                f"--host {where} is reachable beyond this machine and no API key is set: set one "
                f"({_HOW_TO_SET}), or pass --allow-unauthenticated if anyone who reaches the port may use it"
            )


_HOW_TO_SET = f"{ENV_VAR}=KEY[,KEY...], --api-key-file FILE or --api-key KEY"


def load_keys(
    cli_keys: Sequence[str] = (), key_file: str | Path | None = None, env: str | None = None
) -> frozenset[str]:
    """The union of `--api-key` values, the lines of `--api-key-file` (blank and `#` lines
    skipped) and the comma-separated `HYBRIDKV_API_KEY`. A source that is given but holds no
    key is an error, not an open server."""
    keys: set[str] = set()
    for key in cli_keys:
        keys.add(_check_key(key.strip(), "--api-key"))
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise AccessError(f"--api-key-file {key_file}: cannot read it: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise AccessError(f"--api-key-file {key_file}: is not UTF-8 text") from None
        stripped = [(n, line.strip()) for n, line in enumerate(lines, 1)]
        found = [(n, key) for n, key in stripped if key and not key.startswith("#")]
        if not found:
            raise AccessError(f"--api-key-file {key_file} holds no key (one key a line; # starts a comment)")
        keys.update(_check_key(key, f"--api-key-file {key_file} line {n}") for n, key in found)
    if env is not None:
        items = [item.strip() for item in env.split(",") if item.strip()]
        if not items:
            raise AccessError(f"{ENV_VAR} is set but holds no key (give KEY or KEY1,KEY2; or unset it)")
        keys.update(_check_key(key, ENV_VAR) for key in items)
    return frozenset(keys)


def exposed_addresses(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to that are not loopback (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise AccessError(f"--host {host}: {e}") from None
    exposed: list[str] = []
    for *_, sockaddr in infos:
        address = str(sockaddr[0])
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope ("fe80::1%eth0") is not part of it
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_loopback and address not in exposed:
            exposed.append(address)
    return exposed


def api_key(request: Request) -> int | None:
    """Which key the request came with (its index), None on a server without keys or a public route."""
    key: int | None = request.scope.get(_SCOPE_KEY)
    return key


class RequireKey:
    """ASGI middleware: a request off the public routes without a valid bearer key gets a 401
    before any route runs, so before its body is read, whatever the route (404s included)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.access.keys:
            await self.app(scope, receive, send)
            return
        if self.access.is_public(scope.get("method", "GET"), scope["path"]):
            await self.app(scope, receive, send)
            return
        token = _bearer(scope["headers"])
        key = None if token is None else self.access.match(token)
        if key is None and token is not None and self._router_probe(scope["path"], token):
            await self.app(scope, receive, send)  # a router's probe: counted under no client's key
            return
        if key is not None:
            scope[_SCOPE_KEY] = key
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _refuse(scope["path"], send, missing=token is None)

    def _router_probe(self, path: str, token: bytes) -> bool:
        router_key = self.access.router_key
        if path not in ROUTER_PATHS or router_key is None:
            return False
        return hmac.compare_digest(_digest(token), _digest(router_key.encode()))


async def _refuse(path: str, send: Send, missing: bool) -> None:
    if missing:
        message = "this server needs an API key: send the header 'Authorization: Bearer KEY'"
        challenge = b'Bearer realm="hybridkv"'
    else:
        message = "the API key is not valid for this server"
        challenge = b'Bearer realm="hybridkv", error="invalid_token"'
    body = json.dumps(error_body(path, 401, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", challenge),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization: Bearer TOKEN` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


def _check_key(key: str, where: str) -> str:
    # A key travels in a header: printable ASCII, no spaces. The message never shows the key.
    if not key:
        raise AccessError(f"{where}: a key cannot be empty")
    if not all("!" <= c <= "~" for c in key):
        raise AccessError(f"{where}: a key must be printable ASCII without spaces (it is sent in a header)")
    return key


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()
