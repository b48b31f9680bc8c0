"""Structured output and forced tool calls through the official clients, served from the default
model: answers parse and validate against their schema unless they ran out of tokens (greedy and
sampled, streamed or not, many requests at once so constrained and free ones share batches),
forced calls come back as `tool_calls`, and what cannot be enforced is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from json_schemas import SCHEMAS, check_answer
from served import MODEL, Served, make_llm, start, stop

from hybridkv.default_model import default_model_dir

MAX_TOKENS = 48
QUESTION = [{"role": "user", "content": "Describe the result as JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 12}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the docs", "parameters": SEARCH}},
]
PARAMETERS = {"get_weather": WEATHER, "search": SEARCH}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    served, thread = start(make_llm(default_model_dir()))
    yield served
    stop(served, thread)


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def response_format(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


async def openai_chat(client: openai.AsyncOpenAI, stream: bool, **request: Any) -> tuple[str, list[Any], str | None]:
    """(content, tool calls as (name, arguments), finish reason), assembled from deltas when streamed."""
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, **request}
    if not stream:
        out = await client.chat.completions.create(**request)
        [choice] = out.choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, finish, pieces = "", None, {}
    async for chunk in await client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                pieces[call.index] = (call.function.name, call.function.arguments)
            finish = choice.finish_reason or finish
    return content, list(pieces.values()), finish


async def _gather(served: Served, requests: list[tuple[bool, dict[str, Any]]]) -> list[Any]:
    async with served.async_openai() as client:
        return await asyncio.gather(*(openai_chat(client, stream, **request) for stream, request in requests))


def test_openai_answers_validate_against_their_schemas(served: Served) -> None:
    requests = []
    for i, schema in enumerate(SCHEMAS):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
            requests += [(stream, {"response_format": response_format(schema), **sampling}) for stream in (False, True)]
    requests += [(False, {"max_tokens": 8})]  # a free request in the same batches
    answers = asyncio.run(_gather(served, requests))
    finished = 0
    for (_, request), (content, calls, finish) in zip(requests[:-1], answers[:-1], strict=True):
        assert not calls and finish in ("stop", "length")
        if finish == "stop":
            check_answer(content, request["response_format"]["json_schema"]["schema"])
            finished += 1
    assert finished >= 0.6 * len(requests)  # the property was tested, not skipped by `length`
    assert answers[-1][2] in ("stop", "length")


def test_json_object_and_strict_schemas(served: Served) -> None:
    loose = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    requests = [(False, {"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": s}) for s in range(4)]
    requests += [
        (s % 2 == 1, {"response_format": response_format(loose, strict=True), "temperature": 1.0, "seed": s})
        for s in range(4)
    ]
    answers = asyncio.run(_gather(served, requests))
    for (_, request), (content, _, finish) in zip(requests, answers, strict=True):
        if finish != "stop":
            continue
        value = json.loads(content)
        assert isinstance(value, dict)
        if request["response_format"]["type"] == "json_schema":  # strict: no property beyond "n"
            assert list(value) == ["n"] and isinstance(value["n"], int)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_comes_back_as_tool_calls(served: Served, stream: bool) -> None:
    one = {"tools": TOOLS, "parallel_tool_calls": False}
    requests = [
        (stream, {**one, "tool_choice": "required", "temperature": 0}),
        (stream, {**one, "tool_choice": "required", "temperature": 1.0, "seed": 3}),
        (stream, {**one, "tool_choice": {"type": "function", "function": {"name": "search"}}, "seed": 5}),
        (stream, {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 4}),  # parallel calls
    ]
    answers = asyncio.run(_gather(served, requests))
    for (_, request), (content, calls, finish) in zip(requests, answers, strict=True):
        assert calls  # a complete call comes first, whatever follows
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        if request.get("parallel_tool_calls") is False:
            assert (content, len(calls), finish) == ("", 1, "tool_calls")
        else:  # the tiny model calls again and again: complete calls come back, cut at the length
            assert finish in ("tool_calls", "length")
        if isinstance(request["tool_choice"], dict):
            assert {name for name, _ in calls} == {"search"}


def test_tool_choice_auto_or_none_without_tools_is_accepted(served: Served) -> None:
    client = served.openai()
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, tool_choice=choice)
        assert out.choices[0].finish_reason in ("stop", "length")


def test_a_schema_with_tools_is_either_the_json_or_calls(served: Served) -> None:
    schema = {"enum": ["sunny", "rainy"]}
    requests = [
        (False, {"tools": TOOLS, "response_format": response_format(schema), "temperature": 1.0, "seed": s})
        for s in range(4)
    ]
    for content, calls, finish in asyncio.run(_gather(served, requests)):
        if finish == "tool_calls":
            assert calls and not content
        elif finish == "stop":
            assert not calls and json.loads(content) in ("sunny", "rainy")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ollama_format_json_and_schema(served: Served, stream: bool) -> None:
    client = served.ollama()
    for schema in ("json", SCHEMAS[0], SCHEMAS[4]):
        options = {"temperature": 0, "num_predict": MAX_TOKENS}
        request: dict[str, Any] = dict(model=MODEL, messages=QUESTION, format=schema, options=options)
        chunks = list(client.chat(**request, stream=True)) if stream else [client.chat(**request)]
        content = "".join(c.message.content or "" for c in chunks)
        if chunks[-1].done_reason == "stop":
            check_answer(content, {"type": "object"} if schema == "json" else schema)
        generated = client.generate(model=MODEL, prompt="JSON:", format=schema, options=options)
        if generated.done_reason == "stop":
            check_answer(generated.response, {"type": "object"} if schema == "json" else schema)


@pytest.mark.parametrize(
    ("request_fields", "field", "words"),
    [
        ({"response_format": response_format({"type": "array", "uniqueItems": True})}, "schema", "uniqueItems"),
        ({"response_format": response_format({"oneOf": [{"type": "integer"}, {"type": "number"}]})}, "schema", "oneOf"),
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "structured output"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "name", "nope"),
        ({"tools": [tool({"type": "array"})]}, "tools[0].function.parameters.type", "object"),
        ({"tools": [tool({"properties": {"a": {"not": {}}}})]}, "tools[0].function.parameters", "not"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(
    served: Served, request_fields: dict[str, Any], field: str, words: str
) -> None:
    if "tools" in request_fields and "tool_choice" not in request_fields:
        request_fields = {**request_fields, "tool_choice": "required"}
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **request_fields)
    assert field in refused.value.message and words in refused.value.message
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")  # still serving


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"format": "xml"}, "format"),
        ({"format": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"format": "json", "options": {"stop": ["}"]}}, "options.stop"),
    ],
)
def test_ollama_format_that_cannot_be_enforced_is_a_400(served: Served, fields: dict[str, Any], words: str) -> None:
    with served.http() as http:  # the ollama client itself refuses format "xml" before sending it
        answer = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False, **fields})
        assert answer.status_code == 400 and words in answer.json()["error"]
        ok = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False, "format": "json"})
        assert ok.status_code == 200 and ok.json()["done"]
