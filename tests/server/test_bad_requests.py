"""Malformed and hostile requests get a clear 4xx naming what is wrong, and the server keeps serving:
after each one, a valid request succeeds."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from served import MAX_MODEL_LEN, MODEL, Served

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
TEN_MB = "x" * (10 << 20)

CASES: list[tuple[str, str, Any, int, str]] = [
    # (id, path, body: dict or raw bytes, status, text the error must contain)
    ("invalid-json", "/v1/chat/completions", b'{"model": "tiny-chat", "messages": [', 400, "not valid JSON"),
    ("invalid-json-ollama", "/api/chat", b"{nope}", 400, "not valid JSON"),
    ("nan", "/v1/completions", b'{"model": "tiny-chat", "prompt": "a", "temperature": NaN}', 400, "NaN"),
    ("not-an-object", "/v1/chat/completions", b"[1, 2, 3]", 400, "must be a JSON object"),
    ("messages-type", "/v1/chat/completions", CHAT | {"messages": "hi"}, 400, "messages"),
    ("message-role", "/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("temperature-type", "/v1/chat/completions", CHAT | {"temperature": "hot"}, 400, "temperature"),
    ("n-type", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 1.5}, 400, "n"),
    ("negative-max-tokens", "/v1/chat/completions", CHAT | {"max_tokens": -1}, 400, "max_tokens"),
    ("negative-num-predict", "/api/generate", GENERATE | {"options": {"num_predict": -5}}, 400, "num_predict"),
    ("options-type", "/api/generate", GENERATE | {"options": "fast"}, 400, "options"),
    ("prompt-type", "/v1/completions", {"model": MODEL, "prompt": {"text": "a"}}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ("too-many-tokens", "/v1/completions", {"model": MODEL, "prompt": "y" * 2 * MAX_MODEL_LEN}, 400, "max_model_len"),
    ("ten-mb-prompt", "/v1/completions", {"model": MODEL, "prompt": TEN_MB}, 413, "larger than the limit"),
    ("ten-mb-ollama", "/api/generate", {"model": MODEL, "prompt": TEN_MB}, 413, "larger than the limit"),
    ("unknown-model", "/v1/chat/completions", CHAT | {"model": "gpt-4o"}, 404, "gpt-4o"),
    ("unknown-model-ollama", "/api/chat", {"model": "llama3", "messages": []}, 404, "llama3"),
    ("missing-model", "/v1/completions", {"prompt": "a"}, 400, "model"),
    ("logit-bias", "/v1/chat/completions", CHAT | {"logit_bias": {"65": 10}}, 400, "logit_bias"),
    (
        "json-schema",
        "/v1/chat/completions",
        CHAT | {"response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    ("tool-choice", "/v1/chat/completions", CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    (
        "unenforceable-schema",
        "/v1/chat/completions",
        CHAT | {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
        400,
        "response_format.json_schema.schema",
    ),
    ("format", "/api/generate", GENERATE | {"format": "xml"}, 400, "format"),
    ("unknown-field", "/v1/chat/completions", CHAT | {"frobnicate": True}, 400, "frobnicate"),
    (
        "image-part",
        "/v1/chat/completions",
        CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "type",
    ),
    ("echo-type", "/v1/completions", {"model": MODEL, "prompt": "a", "echo": "yes"}, 400, "echo"),
    ("max-tokens-0", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "echo: true"),
    (
        "prompt-logprobs-streamed",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs: is not available with stream",
    ),
    ("prompt-logprobs-range", "/v1/chat/completions", CHAT | {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (
        "max-tokens-1e8",
        "/v1/completions",
        {"model": MODEL, "prompt": "abc", "max_tokens": 1e8},
        400,
        f"max_tokens: 100000000 tokens do not fit after a prompt of 3 tokens in this model's {MAX_MODEL_LEN}-token",
    ),
    (
        "max-tokens-past-context",
        "/v1/completions",
        {"model": MODEL, "prompt": [[1, 2], [1] * (MAX_MODEL_LEN - 8)], "max_tokens": 10},
        400,
        f"after a prompt of {MAX_MODEL_LEN - 8} tokens",
    ),
    (
        "max-completion-tokens-past-context",
        "/v1/chat/completions",
        {**CHAT, "max_tokens": None, "max_completion_tokens": MAX_MODEL_LEN},
        400,
        f"max_completion_tokens: {MAX_MODEL_LEN} tokens do not fit",
    ),
    ("num-ctx-full", "/api/generate", GENERATE | {"options": {"num_ctx": 3}}, 400, "options.num_ctx: "),
    ("n-too-large", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 9}, 400, "max_num_seqs"),
    ("unknown-route", "/v1/embeddings", {"model": MODEL, "input": "a"}, 404, "/v1/embeddings"),
]


@pytest.mark.parametrize(("path", "body", "status", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_refused_clearly_and_the_server_keeps_serving(
    served: Served, path: str, body: Any, status: int, text: str
) -> None:
    with served.http() as http:
        started = time.monotonic()
        if isinstance(body, bytes):
            answer = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            answer = http.post(path, json=body)
        assert time.monotonic() - started < 5  # refused cheaply, whatever the size
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        message = error if path.startswith("/api/") else error["message"]
        assert text in message
        ok = http.post(
            "/api/generate" if path.startswith("/api/") else "/v1/chat/completions",
            json=GENERATE if path.startswith("/api/") else CHAT,
        )
        assert ok.status_code == 200, ok.text


def test_the_openai_client_sees_typed_errors(served: Served) -> None:
    client = served.openai()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert error.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_max_tokens_past_the_context_names_both_numbers(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        served.openai().completions.create(model=MODEL, prompt="abcd", max_tokens=MAX_MODEL_LEN)
    assert error.value.body["param"] == "max_tokens"  # type: ignore[index]
    message = error.value.body["message"]  # type: ignore[index]
    assert f"{MAX_MODEL_LEN} tokens" in message and "a prompt of 4 tokens" in message
    assert f"at most {MAX_MODEL_LEN - 4}" in message
    fits = served.openai().completions.create(model=MODEL, prompt="abcd", max_tokens=MAX_MODEL_LEN - 4, stop=["\n"])
    assert fits.choices


def test_ollama_clamps_num_predict_and_blames_num_ctx_only_when_sent(served: Served) -> None:
    client = served.http()
    body = {"model": MODEL, "prompt": "abc", "raw": True, "stream": False}
    options = {"num_predict": 10**8, "num_ctx": 24, "temperature": 0, "stop": []}
    out = client.post("/api/generate", json=body | {"options": options}).json()
    assert (out["prompt_eval_count"], out["eval_count"], out["done_reason"]) == (3, 21, "length")  # as ollama does

    long = body | {"prompt": "y" * MAX_MODEL_LEN}
    answer = client.post("/api/generate", json=long)
    assert answer.status_code == 400
    n = MAX_MODEL_LEN
    assert answer.json()["error"] == f"prompt: {n} tokens leave no room in this model's {n}-token context"
    answer = client.post("/api/generate", json=long | {"options": {"num_ctx": 16}})
    assert answer.json()["error"] == f"options.num_ctx: {n} tokens leave no room in a 16-token context (num_ctx)"
