"""What the routers add and ask for, against one in-process server: their fields accepted at our
own values and refused (400 naming the field) otherwise; SGLang's model info; vLLM's /tokenize
giving exactly the ids the chat runs, remembered answers included; a router's own key valid on
/tokenize only."""

from __future__ import annotations

import httpx
import pytest
from served import MODEL, Served
from starlette.testclient import TestClient

from hybridkv.server.app import create_app
from hybridkv.server.auth import Access
from hybridkv.server.router_compat import CHAT_FIELDS, COMPLETION_FIELDS, INFO_PATHS

CHAT = [{"role": "user", "content": "What does a list hold?"}]


def _chat(http: httpx.Client, messages: list[dict[str, str]], **fields: object) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    return http.post("/v1/chat/completions", json=body)


def test_router_fields_at_our_values_are_accepted(served: Served) -> None:
    with served.http() as http:
        ours = {name: value for name, (value, _) in CHAT_FIELDS.items()}
        assert _chat(http, CHAT, **ours, max_completion_tokens=4, max_tokens=None).status_code == 200
        ours = {name: value for name, (value, _) in COMPLETION_FIELDS.items()}
        body = {"model": MODEL, "prompt": "The list", "max_tokens": 2, **ours}
        assert http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("name", sorted(CHAT_FIELDS))
def test_a_chat_field_at_another_value_is_a_400_naming_it(served: Served, name: str) -> None:
    with served.http() as http:
        answer = _chat(http, CHAT, **{name: not CHAT_FIELDS[name][0]})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == name
    assert name in answer.json()["error"]["message"]


@pytest.mark.parametrize("name", sorted(COMPLETION_FIELDS))
def test_a_completion_field_at_another_value_is_a_400_naming_it(served: Served, name: str) -> None:
    body = {"model": MODEL, "prompt": "The list", "max_tokens": 2, name: not COMPLETION_FIELDS[name][0]}
    with served.http() as http:
        answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == name


@pytest.mark.parametrize("path", INFO_PATHS)
def test_model_info_names_the_served_model(served: Served, path: str) -> None:
    with served.http() as http:
        info = http.get(path).json()
    assert info["served_model_name"] == MODEL
    assert info["model_path"] == str(served.llm.model_dir)


def test_tokenize_gives_the_ids_each_chat_turn_runs(served: Served) -> None:
    """vLLM's reply shape; the count is the chat's prompt_tokens, and the second turn's ids extend
    the first turn's with the very ids generated for the answer (its cache hit covers both)."""
    with served.http() as http:
        first = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()
        assert set(first) >= {"count", "max_model_len", "tokens"} and first["count"] == len(first["tokens"])
        answer = _chat(http, CHAT, max_tokens=12).json()
        assert answer["usage"]["prompt_tokens"] == first["count"]
        turn = [*CHAT, answer["choices"][0]["message"], {"role": "user", "content": "And a dict?"}]
        turn[1] = {"role": "assistant", "content": turn[1]["content"]}
        second = http.post("/tokenize", json={"model": MODEL, "messages": turn, "continue_final_message": False})
        second_ids = second.json()["tokens"]
        reply = _chat(http, turn).json()["usage"]
    assert reply["prompt_tokens"] == len(second_ids)
    assert second_ids[: first["count"]] == first["tokens"]
    # Every token up to the end of the answer came from the cache: the ids matched exactly.
    assert reply["prompt_tokens_details"]["cached_tokens"] >= first["count"] + answer["usage"]["completion_tokens"] - 1


def test_tokenize_a_prompt_and_refuse_what_it_cannot_do(served: Served) -> None:
    with served.http() as http:
        prompt = http.post("/tokenize", json={"model": MODEL, "prompt": "The list"}).json()
        assert prompt["tokens"] == served.llm.tokenizer.encode("The list")
        refused = http.post("/tokenize", json={"messages": CHAT, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_a_router_key_opens_only_the_tokenize_probe(served: Served) -> None:
    """vllm-router sends its own key on /tokenize, and also on /api/*, /metrics and /: a worker
    takes it on the probe only, so the router cannot open the rest to clients without a key."""
    access = Access(frozenset({"user-key"}), router_key="router-key")
    client = TestClient(create_app(served.llm, MODEL, access=access))  # no lifespan: the engine is served's
    router = {"Authorization": "Bearer router-key"}
    assert client.post("/tokenize", json={"prompt": "x"}, headers=router).status_code == 200
    for method, path in (("GET", "/api/tags"), ("GET", "/metrics"), ("GET", "/v1/models")):
        assert client.request(method, path, headers=router).status_code == 401, path
    assert client.get("/v1/models", headers={"Authorization": "Bearer user-key"}).status_code == 200
