"""The grammars of constrained answers, checked against the models' own templates: a call as the
chat template writes it is accepted, and parses back to its arguments; anything else (another
tool, a wrong type, a second call where one is allowed, text before a forced call) is refused.
Qwen3.5 (XML calls, `<tool_call>` and `</think>` special tokens) and the default model (JSON
calls, the tags as text)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from qwen35_tokenizer import COMPACT_VOCAB, write_qwen35_tokenizer

from hybridkv.default_model import default_model_dir
from hybridkv.engine.chat_template import ChatTemplate
from hybridkv.engine.grammar import Grammar, Grammars
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.server.fields import ApiError
from hybridkv.server.parsing import ToolCall, split_output
from hybridkv.server.structured import Constraint, Tool, ToolStyle, build, closed

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1},
        "units": {"enum": ["metric", "imperial"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
    },
    "required": ["city"],
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
TOOLS = (Tool("get_weather", WEATHER, "tools[0].function.parameters"), Tool("search", SEARCH, "tools[1]"))
CALL = {"name": "get_weather", "arguments": {"city": "Paris\nFrance", "days": 2, "where": {"lat": 48.8}}}
MODELS: dict[str, tuple[Tokenizer, ChatTemplate, int, ToolStyle]] = {}


def model(name: str) -> tuple[Tokenizer, ChatTemplate, int, ToolStyle]:
    """(tokenizer, template, vocab, tool style) of the default model or a Qwen3.5."""
    if name not in MODELS:
        if name == "default":
            path = default_model_dir()
            template = ChatTemplate.from_dir(path)
            assert template is not None
            MODELS[name] = (Tokenizer.from_dir(path), template, 4096, "json")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                write_qwen35_tokenizer(Path(tmp), "3.5", compact=True)
                template = ChatTemplate.from_dir(tmp)
                assert template is not None
                MODELS[name] = (Tokenizer.from_dir(tmp), template, COMPACT_VOCAB, "xml")
    return MODELS[name]


def rendered_calls(template: ChatTemplate, calls: list[dict[str, Any]], content: str = "") -> str:
    """The assistant turn's text as the template writes it, from its first call to its last."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": c} for c in calls]},
    ]
    text = template.render(messages, add_generation_prompt=False, tools=[])
    turn = text[text.rindex("<|im_start|>assistant\n") :]
    start = turn.index(content or "<tool_call>")
    return turn[start : turn.rindex("</tool_call>") + len("</tool_call>")]


def accepts(name: str, grammar: Grammar, text: str) -> bool:
    tokenizer, _, vocab, _ = model(name)
    matcher = Grammars(tokenizer, vocab).matcher(grammar).matcher
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


def grammar(name: str, constraint: Constraint, thinking: bool = False) -> Grammar:
    tokenizer, _, vocab, style = model(name)
    result = build(constraint, Grammars(tokenizer, vocab), style, thinking)
    assert result is not None
    return result


@pytest.mark.parametrize("name", ["default", "qwen3.5"])
def test_a_forced_call_as_the_template_writes_it_is_accepted_and_parses_back(name: str) -> None:
    _, template, _, _ = model(name)
    forced = grammar(name, Constraint(tools=TOOLS, calls="required", parallel=False))
    text = rendered_calls(template, [CALL])
    assert accepts(name, forced, text)
    [call] = split_output(text, schemas={"get_weather": WEATHER})
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == (CALL["name"], CALL["arguments"])
    thinking = grammar(name, Constraint(tools=TOOLS, calls="required", parallel=False), thinking=True)
    assert accepts(name, thinking, "The user wants the weather.\n</think>\n\n" + text)
    assert not accepts(name, thinking, text)


@pytest.mark.parametrize("name", ["default", "qwen3.5"])
def test_what_the_tools_do_not_allow_is_refused(name: str) -> None:
    _, template, _, _ = model(name)
    forced = grammar(name, Constraint(tools=TOOLS, calls="required", parallel=False))
    for wrong in (
        {"name": "get_weather", "arguments": {"city": "Paris", "days": "two"}},  # a string for an integer
        {"name": "get_weather", "arguments": {"days": 2}},  # the required city missing
        {"name": "get_weather", "arguments": {"city": "Paris", "units": "kelvin"}},  # not in the enum
        {"name": "delete_everything", "arguments": {}},  # no such tool
    ):
        assert not accepts(name, forced, rendered_calls(template, [wrong])), wrong
    assert not accepts(name, forced, "Sure!\n" + rendered_calls(template, [CALL]))  # a forced call comes alone
    named = grammar(name, Constraint(tools=TOOLS[1:], calls="required"))
    assert not accepts(name, named, rendered_calls(template, [CALL]))
    assert accepts(name, named, rendered_calls(template, [{"name": "search", "arguments": {"query": "rain"}}]))


@pytest.mark.parametrize("name", ["default", "qwen3.5"])
def test_parallel_calls_or_at_most_one(name: str) -> None:
    _, template, _, _ = model(name)
    second = {"name": "search", "arguments": {"query": "umbrella"}}
    two = rendered_calls(template, [CALL, second])
    assert accepts(name, grammar(name, Constraint(tools=TOOLS, calls="required")), two)
    assert not accepts(name, grammar(name, Constraint(tools=TOOLS, calls="required", parallel=False)), two)
    at_most_one = grammar(name, Constraint(tools=TOOLS, calls="auto", parallel=False))
    assert accepts(name, at_most_one, "No call is needed: it is sunny.")
    assert accepts(name, at_most_one, rendered_calls(template, [CALL], content="Let me check."))
    assert not accepts(name, at_most_one, rendered_calls(template, [CALL, second], content="Let me check."))


def test_json_content_or_calls() -> None:
    either = grammar("default", Constraint({"type": "integer"}, "response_format", TOOLS, "auto"))
    _, template, _, _ = model("default")
    assert accepts("default", either, "42")
    assert accepts("default", either, rendered_calls(template, [CALL]))
    assert not accepts("default", either, "forty-two")


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}, "properties.code.pattern"),
        ({"properties": {"when": {"type": "string", "format": "date"}}}, "properties.when.format"),
        ({"properties": {"p": {"$ref": "#/$defs/p"}}, "$defs": {"p": {"type": "integer"}}}, "properties.p.$ref"),
        ({"properties": {"n": {"type": ["integer", "string"]}}}, "properties.n"),
        ({"properties": {"a<b": {"type": "integer"}}}, "properties"),
        ({"properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
        ({"properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required"),
    ],
)
def test_what_the_xml_format_cannot_say_is_a_400_naming_it(parameters: dict[str, Any], field: str) -> None:
    constraint = Constraint(tools=(Tool("f", {"type": "object", **parameters}, "tools[0].function.parameters"),))
    with pytest.raises(ApiError) as refused:
        grammar("qwen3.5", Constraint(tools=constraint.tools, calls="required"))
    assert refused.value.status == 400 and refused.value.param == f"tools[0].function.parameters.{field}"
    if field.startswith("properties."):  # what JSON calls can say
        grammar("default", Constraint(tools=constraint.tools, calls="required"))


def test_strict_closes_every_object_but_keeps_what_was_said() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"a": {}}}, "open": {"additionalProperties": True}},
        "$defs": {"d": {"properties": {"b": {}}}},
        "allOf": [{"properties": {"c": {}}}],
    }
    strict = closed(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["inner"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] is True
    assert strict["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["allOf"][0]  # each part of an allOf sees only some properties
    assert "additionalProperties" not in schema  # the request's schema is not changed
