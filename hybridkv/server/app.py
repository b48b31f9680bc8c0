"""The ASGI app: one `LLM`, its engine running in its own thread, the OpenAI routes under /v1,
the Ollama routes under /api, and /health and /metrics.

Errors are answered in the style of the API that was called: OpenAI's
`{"error": {"message", "type", "param", "code"}}` under /v1, Ollama's `{"error": "..."}` under
/api. A request body is read only up to `max_body` bytes; anything larger is a 413 before any
of it is parsed or tokenized. With API keys (`auth.Access`), a request without a valid key gets a
401 before any route runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hybridkv.engine.chat_template import ChatTemplate
from hybridkv.engine.grammar import Grammar
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import RequestOutput
from hybridkv.engine.sampling import SamplingParams
from hybridkv.server import metrics, ollama, openai, router_compat, structured, tokenize
from hybridkv.server.auth import Access, RequireKey
from hybridkv.server.chatml import CHATML_WITH_TOOLS
from hybridkv.server.fields import ApiError, Fields, bad, error_body
from hybridkv.server.generation import RETRY_AFTER_S, Generation
from hybridkv.server.kv_events import KvEvents
from hybridkv.server.tool_calls import FUNCTION

log = logging.getLogger("hybridkv.server")
LATEST = ":latest"
_DRAIN_LIMIT = 64 << 20  # an oversized body up to this size is read and dropped, so the client sees the 413


class ServerState:
    """What every route needs: the LLM, the one model id, limits, and the HTTP counters."""

    def __init__(
        self, llm: LLM, model_id: str, max_body: int, access: Access | None = None, kv_events: KvEvents | None = None
    ) -> None:
        self.llm = llm
        self.model_id = model_id
        self.max_body = max_body
        self.access = access or Access()
        self.kv_events = kv_events
        self.announced_tokens = 0  # summed over requests: the router's credit, beside the cache's
        self.started = time.time()
        self.serving = False  # between the lifespan's start and end
        self.responses: Counter[tuple[str, int]] = Counter()
        self._encode_lock = threading.Lock()  # LLM's remembered outputs: encode and remember
        self._generations: weakref.WeakSet[Generation] = weakref.WeakSet()  # the ones still referenced
        if llm.template is None and all(
            llm.tokenizer.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>")
        ):
            log.warning("%s has no chat template; chat requests use ChatML (its tokenizer has the tokens)", model_id)
            llm.template = ChatTemplate(CHATML_WITH_TOOLS, {"eos_token": "<|im_end|>"})

    @property
    def max_model_len(self) -> int:
        return int(self.llm.cm.cache.config.max_model_len)

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is this server's model id (a `:latest` tag is accepted)."""
        if name is None:
            raise ApiError(400, "model: is required (this server has " + repr(self.model_id) + ")", param="model")
        if name.removesuffix(LATEST) != self.model_id.removesuffix(LATEST):  # "qwen3:latest" is "qwen3"
            raise ApiError(404, f"model {name!r} not found; this server has {self.model_id!r}", param="model")

    async def read_json(self, request: Request) -> Fields:
        """The body as a JSON object: 413 past `max_body` bytes, 400 if it is not JSON."""
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        body, more = bytearray(), True
        while more and size <= self.max_body:
            message = await request.receive()
            if message["type"] != "http.request":
                raise ApiError(400, "the client went away before sending the whole body")
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size = max(size, len(body) + len(chunk))
            body += chunk
        if size > self.max_body:
            if more:
                await _drain(request)
            limit = self.max_body
            raise ApiError(413, f"the request body ({size} bytes or more) is larger than the limit of {limit} bytes")
        try:
            data = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        return Fields(data)

    def submit(
        self, prompts: Sequence[tuple[list[int], Sequence[int], SamplingParams]], key: int | None = None
    ) -> Generation:
        """Queue the prompts for the client with API key `key`: a 429 if that key already has
        `max_waiting_per_key` requests waiting (other keys are not affected)."""
        limit = self.access.max_waiting_per_key
        if limit is not None and key is not None:
            waiting = sum(g.waiting for g in list(self._generations) if g.key == key)
            if len(prompts) > limit:
                message = f"{len(prompts)} prompts in one request: this server queues at most {limit} per API key"
                raise ApiError(400, message, param="prompt")
            if waiting + len(prompts) > limit:
                message = f"this API key already has {waiting} requests waiting (at most {limit} a key); retry later"
                raise ApiError(429, message, headers={"Retry-After": str(RETRY_AFTER_S)})
        announced = [self.kv_events.announced(ids) for ids, _, _ in prompts] if self.kv_events else None
        generation = Generation.submit(self.llm.engine, prompts, key)
        if announced is not None:
            generation.announced = sum(announced)
            self.announced_tokens += generation.announced
        self._generations.add(generation)
        return generation

    def cancel_all(self) -> None:
        """End every request in flight: each stream ends with its last chunk, finish reason cancelled."""
        for generation in list(self._generations):
            generation.cancel()

    async def encode(self, text: str) -> list[int]:
        return await run_in_threadpool(self.llm.encode, text)

    async def encode_chat(
        self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        if self.llm.template is None:
            raise ApiError(400, f"model {self.model_id!r} has no chat template: use the completion endpoints")

        def encode() -> tuple[list[int], list[int]]:
            with self._encode_lock:
                return self.llm.encode_chat(messages, tools, **kwargs)

        try:
            return await run_in_threadpool(encode)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        except Exception as e:  # the template refused (raise_exception) or failed on this input
            raise ApiError(400, f"the chat template could not render these messages: {e}", param="messages") from None

    def remember(self, outputs: Sequence[RequestOutput]) -> None:
        """Keep generated ids, so the next turn of the conversation hits the cache exactly."""
        with self._encode_lock:
            for output in outputs:
                self.llm.remember(output)

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Does the prompt end inside a think block (a thinking template's generation prompt)?"""
        tail = self.llm.tokenizer.decode(prompt_ids[-8:]).rstrip()
        return tail.endswith("<think>")

    @property
    def tool_style(self) -> structured.ToolStyle:
        """How the model writes a tool call: XML (`<function=...>`, Qwen3.5) if its chat template
        shows that form, else JSON (Hermes: Qwen3, Qwen3-Next, the default model's ChatML)."""
        sources = self.llm.template.templates.values() if self.llm.template is not None else ()
        return "xml" if any(FUNCTION in source for source in sources) else "json"

    async def constrained(
        self, params: SamplingParams, constraint: structured.Constraint, thinking: bool, prefix: str = ""
    ) -> tuple[SamplingParams, Grammar | None]:
        """`params` with the grammar of `constraint` (None when it constrains nothing), built and
        checked off the event loop. 400 naming the field for what cannot be enforced, and for a
        sampling field that cannot go with a grammar (`prefix` + its name, e.g. "options.")."""
        grammars, style = self.llm.engine.grammars, self.tool_style
        grammar = await run_in_threadpool(structured.build, constraint, grammars, style, thinking)
        if grammar is None:
            return params, None
        try:
            return dataclasses.replace(params, grammar=grammar), grammar
        except ValueError as e:  # "stop cannot be combined with structured output: ..."
            name, _, rest = str(e).partition(" ")
            raise bad(prefix + name, rest) from None


def create_app(
    llm: LLM,
    model_id: str | None = None,
    max_body: int | None = None,
    access: Access | None = None,
    kv_events: KvEvents | None = None,
) -> Starlette:
    """The app serving `llm` as `model_id` (default: its source's served name). The engine thread
    starts with the app's lifespan and is shut down (cancelling what still runs) at its end.
    `max_body` defaults to 1 MiB or 64 bytes per context token, whichever is larger. `access`:
    the API keys every route off the public ones needs (default: none, anyone may call).
    `kv_events`: a bound publisher the prefix index announces its blocks to (closed at the end)."""
    state = ServerState(
        llm,
        model_id or llm.source.served_name,
        max_body or max(1 << 20, 64 * int(llm.cm.cache.config.max_model_len)),
        access,
        kv_events,
    )
    if kv_events is not None:
        llm.engine.index.listeners.append(kv_events.on_index)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        llm.engine.start()
        state.serving = True
        try:
            yield
        finally:
            state.serving = False
            await run_in_threadpool(llm.engine.shutdown)
            if kv_events is not None:
                kv_events.close()

    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/health", health, methods=["GET", "HEAD"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *openai.routes(),
        *ollama.routes(),
        *router_compat.routes(),
        *tokenize.routes(),
    ]
    handlers: Mapping[Any, Any] = {ApiError: api_error, HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = state
    app.add_middleware(RequireKey, access=state.access)  # inside the counting: 401s are counted
    app.add_middleware(metrics.CountResponses, counts=state.responses)
    return app


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def root(request: Request) -> Response:
    return PlainTextResponse("hybridkv is running")  # what Ollama answers; some clients probe it


async def health(request: Request) -> Response:
    alive = server_state(request).serving
    return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)


async def prometheus(request: Request) -> Response:
    state = server_state(request)
    announced = state.announced_tokens if state.kv_events is not None else None
    text = metrics.render(state.llm.engine.metrics(), state.responses, state.model_id, announced)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    body = error_body(request.url.path, exc.status, exc.message, exc.param)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(request.url.path, exc.status_code, message), status_code=exc.status_code)


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("error serving %s %s", request.method, request.url.path, exc_info=exc)
    message = f"internal error: {type(exc).__name__}: {exc}"
    return JSONResponse(error_body(request.url.path, 500, message), status_code=500)


async def _drain(request: Request) -> None:
    """Read and drop the rest of an oversized body (up to a limit), so that the client, still
    sending, gets to read the 413 instead of a reset connection."""
    seen = 0
    while seen <= _DRAIN_LIMIT:
        message = await request.receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
