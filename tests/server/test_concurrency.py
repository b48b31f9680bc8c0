"""Many clients at once: one continuous batch gives each the answer it gets alone; a client that
goes away frees its sequence at once; a full queue answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path

import httpx
from served import MODEL, Served, make_llm, start, stop

CLIENTS = 16


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Client {i} asks question {i * 7}."}]


def test_sixteen_streams_at_once_each_get_what_they_get_alone(served: Served) -> None:
    client = served.openai()
    alone = []
    for i in range(CLIENTS):
        out = client.chat.completions.create(model=MODEL, messages=prompt(i), max_tokens=16 + i, temperature=0)
        alone.append(out.choices[0].message.content)

    async def stream(aclient: object, i: int) -> str:
        chunks = await aclient.chat.completions.create(  # type: ignore[attr-defined]
            model=MODEL, messages=prompt(i), max_tokens=16 + i, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def all_at_once() -> list[str]:
        aclient = served.async_openai()
        return await asyncio.gather(*(stream(aclient, i) for i in range(CLIENTS)))

    peak = [0.0]
    watching = threading.Event()

    def watch() -> None:  # the engine really batched them: many ran at the same time
        while not watching.is_set():
            peak[0] = max(peak[0], served.metrics()["hybridkv_requests_running"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        together = asyncio.run(all_at_once())
    finally:
        watching.set()
        watcher.join()
    assert together == alone
    assert peak[0] >= 4


def test_a_client_that_disconnects_is_cancelled_and_its_sequence_released(served: Served) -> None:
    llm = served.llm
    served.wait_idle()
    before = served.metrics()
    request = {
        "model": MODEL,
        "messages": prompt(99),
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # (closing this iterator would close the connection)
        chunks = [line for line in itertools.islice(lines, 6) if line.startswith("data: ")]
        assert len(chunks) == 3  # the role, then two pieces of text
        assert served.metrics()["hybridkv_requests_running"] == 1
        response.close()  # the client goes away mid-stream
    gone = served.wait_idle(timeout=1.0)
    after = served.metrics()
    assert gone < 1.0
    assert (
        after['hybridkv_requests_total{status="cancelled"}']
        == before['hybridkv_requests_total{status="cancelled"}'] + 1
    )
    assert after["hybridkv_generation_tokens_total"] - before["hybridkv_generation_tokens_total"] < 900
    time.sleep(0.05)  # the engine thread is idle now: its bookkeeping can be read
    llm.cm.cache.check_integrity()
    assert len(llm.cm.cache.sequences()) == len(llm.engine.index)  # only the prefix cache holds sequences
    assert [m["model"] for m in served.http().get("/api/ps").json()["models"]] == [MODEL]


def test_a_full_queue_answers_429_with_retry_after(model_dir: Path) -> None:
    small, thread = start(make_llm(model_dir, max_num_seqs=1, max_queue=1))
    try:
        long = {"model": MODEL, "prompt": "busy", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=small.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long | {"stream": True}) as running:
                lines = running.iter_lines()
                next(lines)  # the first request runs
                with http.stream("POST", "/v1/completions", json=long | {"stream": True}) as waiting:
                    deadline = time.monotonic() + 5
                    while small.metrics()["hybridkv_requests_waiting"] < 1:  # the second one waits
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    refused = http.post("/v1/completions", json=long)
                    assert refused.status_code == 429
                    assert refused.headers["Retry-After"] == "1"
                    assert "retry" in refused.json()["error"]["message"]
                    assert waiting.status_code == 200
            small.wait_idle(timeout=2.0)
            ok = http.post("/v1/completions", json=long | {"max_tokens": 2})
            assert ok.status_code == 200
            assert small.metrics()['hybridkv_requests_total{status="rejected"}'] == 1
    finally:
        stop(small, thread)


def test_shutdown_ends_running_streams_cleanly(model_dir: Path) -> None:
    """Streams still running when the server stops get its grace period (0.1 s here, far less than
    the 900 tokens take), then end with a last chunk (finish reason "abort") and [DONE] instead of
    a cut connection."""
    served, thread = start(make_llm(model_dir, max_num_seqs=2), grace=0.1)
    long = {"model": MODEL, "prompt": "forever", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=long) as s:
        lines = s.iter_lines()
        next(lines)
        served.server.should_exit = True
        rest = [line.removeprefix("data: ") for line in lines if line]
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    assert len(rest) < 900  # it did not run to the end
