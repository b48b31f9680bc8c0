"""A server with API keys: every route off the public allowlist (the app's own route table is
walked, so a new route cannot be forgotten) answers 401 without the right key, before it reads the
body, in the called API's style; the official openai and ollama clients work with a key, streaming
included; no key shows in an answer or a log line; one key's flood is refused while another key
passes; and the same over TLS."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from served import MODEL, Served, make_llm, start, stop
from starlette.routing import Route
from starlette.testclient import TestClient

from hybridkv.server.app import create_app
from hybridkv.server.auth import Access

KEY, OTHER_KEY, WRONG_KEY = "hkv-test-key-1", "hkv-test-key-2", "hkv-not-a-key"
PUBLIC = {("GET", "/"), ("HEAD", "/"), ("GET", "/health"), ("HEAD", "/health"), ("GET", "/api/version")}
PUBLIC |= {("HEAD", "/api/version")}
CHAT = [{"role": "user", "content": "hi"}]
FULL = {"ignore_eos": True}  # (vLLM's extension) exactly max_tokens, whatever is sampled


@pytest.fixture(scope="module")
def guarded(model_dir: Path) -> Iterator[Served]:
    served, thread = start(make_llm(model_dir), access=Access(frozenset({KEY, OTHER_KEY})), key=KEY)
    yield served
    stop(served, thread)


def route_calls(served: Served) -> list[tuple[str, str]]:
    """(method, path) for every method of every route of the served app, path parameters filled in."""
    app = served.server.config.app
    calls = []
    for route in app.routes:
        assert isinstance(route, Route)
        path = re.sub(r"\{[^}]*\}", MODEL, route.path)
        calls += [(method, path) for method in sorted(route.methods or ())]
    return calls


def test_every_route_off_the_allowlist_needs_the_key(guarded: Served) -> None:
    calls = route_calls(guarded) + [("POST", "/v1/embeddings"), ("GET", "/api/nothing-here")]  # 404s too
    assert {("POST", "/v1/chat/completions"), ("POST", "/api/chat"), ("GET", "/metrics")} <= set(calls)
    assert set(calls) >= PUBLIC
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for method, path in calls:
            if (method, path) in PUBLIC:
                assert http.request(method, path).status_code == 200, (method, path)
                continue
            for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": f"Basic {KEY}"}):
                answer = http.request(method, path, headers=headers)
                assert answer.status_code == 401, (method, path, headers)
                assert answer.headers["WWW-Authenticate"].startswith("Bearer"), (method, path)
                if method != "HEAD":
                    assert WRONG_KEY not in answer.text and KEY not in answer.text
                    error = answer.json()["error"]
                    if path.startswith("/api/"):
                        assert isinstance(error, str) and "API key" in error
                    else:
                        assert error["code"] == "invalid_api_key" and "API key" in error["message"]
            with_key = http.request(method, path, headers=guarded.headers)  # (the key reaches every route)
            assert with_key.status_code in (200, 400, 404), (method, path, with_key.text)
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}).is_error
        ok = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}, headers=guarded.headers
        )
        assert ok.status_code == 200  # still serving


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
def test_a_huge_or_malformed_body_without_a_key_is_a_401_unread(guarded: Served, path: str) -> None:
    huge = b'{"prompt": "' + b"x" * (20 << 20) + b'"}'  # 20 MiB: a 413 with the key
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for body in (huge, b"{not json", b"\xff\xfe"):
            started = time.monotonic()
            answer = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 401, answer.text
            assert time.monotonic() - started < 5
        assert http.post(path, content=huge, headers=guarded.headers).status_code == 413  # with it: read, refused
        assert http.post(path, content=b"{not json", headers=guarded.headers).status_code == 400


def test_the_openai_client_with_and_without_the_key(guarded: Served) -> None:
    client = guarded.openai()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=3,
        extra_body=FULL,
    )
    assert answer.choices[0].finish_reason == "length"
    stream = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True, extra_body=FULL)
    assert [c for c in stream if c.choices][-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == [MODEL]
    for headers in ({}, {"Authorization": ""}):  # a wrong key; none at all (the client insists on one)
        other = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=WRONG_KEY, max_retries=0, default_headers=headers)
        with pytest.raises(openai.AuthenticationError) as refused:
            other.chat.completions.create(model=MODEL, messages=CHAT, stream=True)  # type: ignore[arg-type]
        assert refused.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            other.completions.create(model=MODEL, prompt="Once", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            other.models.list()


def test_the_ollama_client_with_headers_or_ollama_api_key(guarded: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    client = guarded.ollama()  # Client(headers={"Authorization": "Bearer KEY"})
    assert client.generate(model=MODEL, prompt="Hi", options={"num_predict": 3}).done  # (eos may end it sooner)
    chunks = list(client.chat(model=MODEL, messages=CHAT, options={"num_predict": 3}, stream=True))
    assert chunks[-1].done and chunks[-1].done_reason in ("length", "stop")
    assert [m.model for m in client.list().models] == [MODEL]
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}):
        other = ollama.Client(host=guarded.url, headers=headers)
        with pytest.raises(ollama.ResponseError) as refused:
            list(other.chat(model=MODEL, messages=CHAT, stream=True))
        assert refused.value.status_code == 401 and "API key" in refused.value.error
        with pytest.raises(ollama.ResponseError):
            other.list()
    monkeypatch.setenv("OLLAMA_API_KEY", OTHER_KEY)  # the client sends it as a bearer key (ollama >= 0.6)
    assert ollama.Client(host=guarded.url).generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).done


def test_no_key_in_any_log_line(guarded: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    access_log = logging.getLogger("uvicorn.access")  # uvicorn's loggers do not propagate: listen to them too
    error_log = logging.getLogger("uvicorn.error")
    levels = access_log.level, error_log.level
    for logger in (access_log, error_log):
        logger.addHandler(caplog.handler)
        logger.setLevel(logging.DEBUG)
    try:
        with httpx.Client(base_url=guarded.url, timeout=30) as http:
            for key in (KEY, WRONG_KEY, OTHER_KEY):
                body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
                http.post("/v1/completions", json=body, headers=_bearer(key))
                http.post("/api/chat", content=b"{bad", headers=_bearer(key))
                http.get("/metrics", headers=_bearer(key))
    finally:
        for logger, level in zip((access_log, error_log), levels, strict=True):
            logger.removeHandler(caplog.handler)
            logger.setLevel(level)
    assert '"POST /v1/completions HTTP/1.1" 401' in caplog.text  # requests were logged, refusals included
    for key in (KEY, WRONG_KEY, OTHER_KEY):
        assert key not in caplog.text


def test_metrics_need_a_key_unless_public(guarded: Served) -> None:
    closed = TestClient(create_app(guarded.llm, MODEL, access=Access(frozenset({KEY}))))  # no lifespan: no engine
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers=_bearer(KEY)).status_code == 200
    public = TestClient(create_app(guarded.llm, MODEL, access=Access(frozenset({KEY}), metrics_public=True)))
    assert public.get("/metrics").status_code == 200
    assert public.get("/v1/models").status_code == 401
    counted = closed.get("/metrics", headers=_bearer(KEY)).text
    assert 'path="/metrics",status="401"' in counted  # refusals are counted like any answer


def test_one_keys_flood_gets_429_while_another_key_passes(model_dir: Path) -> None:
    """One request runs at a time; key A may have 2 waiting. A's fourth request is refused with
    Retry-After; key B, with nothing waiting, is queued and answered."""
    access = Access(frozenset({KEY, OTHER_KEY}), max_waiting_per_key=2)
    served, thread = start(make_llm(model_dir, max_num_seqs=1), access=access, key=KEY)
    long = {"model": MODEL, "prompt": "busy", "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=served.url, timeout=30, headers=_bearer(KEY)) as http, contextlib.ExitStack() as s:
            for queued in range(3):  # one runs, two wait
                assert s.enter_context(http.stream("POST", "/v1/completions", json=long)).status_code == 200
                # Each request waits until the one before it is where it should be (the first
                # running), so a slow engine start cannot leave three waiting at once.
                deadline = time.monotonic() + 5
                metrics = served.metrics()
                while metrics["hybridkv_requests_running"] < 1 or metrics["hybridkv_requests_waiting"] < queued:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                    metrics = served.metrics()
            flooder = served.openai()
            with pytest.raises(openai.RateLimitError) as refused:
                flooder.completions.create(model=MODEL, prompt="more", max_tokens=2)
            assert refused.value.response.headers["Retry-After"] == "1"
            assert "retry" in refused.value.message
            with pytest.raises(ollama.ResponseError) as also:
                served.ollama().generate(model=MODEL, prompt="more", options={"num_predict": 2})
            assert also.value.status_code == 429
            other = openai.OpenAI(base_url=f"{served.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
            passed = other.completions.create(model=MODEL, prompt="mine", max_tokens=4, stream=True, extra_body=FULL)
            assert served.metrics()["hybridkv_requests_waiting"] == 3
        # A's streams are closed: their requests are cancelled and B's runs to its end
        chunks = [c for c in passed if c.choices]
        assert chunks[-1].choices[0].finish_reason == "length"
        served.wait_idle()
        assert flooder.completions.create(model=MODEL, prompt="again", max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.BadRequestError):  # more prompts than a key may queue: never accepted
            flooder.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
    finally:
        stop(served, thread)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed: no certificate")
def test_tls_round_trip_with_a_key(model_dir: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    access = Access(frozenset({KEY}))
    served, thread = start(make_llm(model_dir), access=access, key=KEY, ssl_certfile=str(cert), ssl_keyfile=str(key))
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        assert served.url.startswith("https://")
        with httpx.Client(verify=trusted) as http:  # (closed: an idle TLS connection holds up the shutdown)
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, http_client=http)
            answer = client.chat.completions.create(
                model=MODEL,
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=3,
                extra_body=FULL,
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 3
            stranger = openai.OpenAI(base_url=f"{served.url}/v1", api_key=WRONG_KEY, max_retries=0, http_client=http)
            with pytest.raises(openai.AuthenticationError):
                stranger.models.list()
        with ollama.Client(host=served.url, headers=served.headers, verify=trusted) as ollama_client:
            assert ollama_client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).done
        untrusting = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
        with untrusting, pytest.raises(openai.APIConnectionError):  # the certificate is really checked
            untrusting.models.list()
    finally:
        stop(served, thread)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
