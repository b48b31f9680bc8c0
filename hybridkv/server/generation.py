"""Engine requests seen from asyncio: the engine thread's events bridged into an `asyncio.Queue`,
cancellation when the HTTP client goes away, and a streaming response that always cleans up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridkv.engine.engine import Engine, QueueFull
from hybridkv.engine.request import Request, RequestOutput, StreamEvent
from hybridkv.engine.sampling import SamplingParams
from hybridkv.server.fields import ApiError

RETRY_AFTER_S = 1


class Generation:
    """The engine requests of one HTTP request (one per prompt; each may have n completions).

    Events arrive as `(prompt index, event)` in the order the engine emitted them. `cancel()`
    is idempotent and safe at any time: finished requests are left alone.
    """

    def __init__(
        self,
        engine: Engine,
        requests: list[Request],
        queue: asyncio.Queue[tuple[int, StreamEvent]],
        key: int | None = None,
    ):
        self.engine = engine
        self.requests = requests
        self.key = key  # the API key it came with (its index), if any
        self.announced: int | None = None  # prompt tokens in blocks announced to the router (KV events)
        self._queue = queue

    @classmethod
    def submit(
        cls,
        engine: Engine,
        prompts: Sequence[tuple[list[int], Sequence[int], SamplingParams]],
        key: int | None = None,
    ) -> Generation:
        """Queue one request per (prompt ids, cache hint, params). A full queue is a 429 (with
        Retry-After), a prompt the engine refuses a 400; either way nothing stays queued."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
        requests: list[Request] = []
        try:
            for i, (ids, hint, params) in enumerate(prompts):
                requests.append(engine.make_request(ids, params, tuple(hint), on_event=_bridge(loop, queue, i)))
        except ValueError as e:
            raise ApiError(400, str(e), param="n" if str(e).startswith("n=") else "prompt") from None
        added: list[Request] = []
        try:
            for request in requests:
                added.append(engine.add_request(request))
        except QueueFull as e:
            for request in added:
                engine.cancel(request.request_id)
            raise ApiError(429, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return cls(engine, requests, queue, key)

    @property
    def waiting(self) -> int:
        """Its requests queued in the engine, not running yet."""
        return sum(1 for request in self.requests if request.queued and not request.finished)

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Every event until each request has sent its last (`done`) one."""
        pending = len(self.requests)
        while pending:
            index, event = await self._queue.get()
            if event.done:
                pending -= 1
            yield index, event

    async def outputs(self, http: HttpRequest) -> list[RequestOutput]:
        """Wait for the end of every request; cancel them if the client disconnects meanwhile."""
        watcher = asyncio.create_task(_on_disconnect(http.receive, self.cancel))
        try:
            async for _ in self.events():
                pass
        finally:
            watcher.cancel()
            self.cancel()
        return [r.output() for r in self.requests]

    def cancel(self) -> None:
        for request in self.requests:
            if not request.finished:
                self.engine.cancel(request.request_id)


class EventStream(StreamingResponse):
    """A streaming response that cancels its generation however the response ends: finished,
    client gone (Starlette cancels the body iterator) or never started."""

    def __init__(self, content: AsyncIterator[str], generation: Generation, media_type: str) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type=media_type, headers=headers)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


def _bridge(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, StreamEvent]], index: int
) -> Callable[[StreamEvent], None]:
    def on_event(event: StreamEvent) -> None:  # runs in the engine thread
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))

    return on_event


async def _on_disconnect(receive: Receive, callback: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            callback()
            return
