"""Tool calls in Qwen3.5's XML form (`<function=…><parameter=…>`) and Qwen3's JSON form come out
of any answer as `ToolCall`s, XML values typed by the request's schema, streamed or not; anything
malformed stays content, as written."""

from __future__ import annotations

import json
import random
from typing import Any

import jinja2
import pytest

from hybridkv.engine.request import Completion
from hybridkv.server.ollama import answer_fields
from hybridkv.server.openai import chat_choice
from hybridkv.server.parsing import Content, OutputParser, Piece, Reasoning, ToolCall, merge, split_output
from hybridkv.server.tool_calls import tool_schemas

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "nights": {"type": "integer"},
                    "budget": {"type": "number"},
                    "breakfast": {"type": "boolean"},
                    "guest": {"type": "object"},
                    "dates": {"type": "array", "items": {"type": "string"}},
                    "note": {"type": ["null", "string"]},
                    "room": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                    "floor": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                    "code": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = tool_schemas(TOOLS)


def xml_call(name: str, **values: str) -> str:
    """A call laid out as the Qwen3.5 template lays it out: every value on its own lines."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def plain(pieces: list[Piece]) -> list[Any]:
    """Pieces without the random call ids."""
    return [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in pieces]


def split(text: str) -> list[Any]:
    return plain(split_output(text, schemas=SCHEMAS))


def the_arguments(text: str) -> dict[str, Any]:
    [call] = split(text)
    assert isinstance(call, tuple), call
    return call[1]


def test_xml_values_take_the_types_of_the_schema() -> None:
    text = xml_call(
        "book",
        city="Paris",
        nights="3",
        budget="120.5",
        breakfast="true",
        guest='{"name": "Ada", "age": 36}',
        dates='["2025-05-01", "2025-05-04"]',
        note="null",
        code="007",
    )
    assert split(text) == [
        (
            "book",
            {
                "city": "Paris",
                "nights": 3,
                "budget": 120.5,
                "breakfast": True,
                "guest": {"name": "Ada", "age": 36},
                "dates": ["2025-05-01", "2025-05-04"],
                "note": None,
                "code": "007",  # a string parameter keeps its digits
            },
        )
    ]


def test_more_values_of_each_type() -> None:
    assert the_arguments(xml_call("book", nights="-2", budget="7", breakfast="False")) == {
        "nights": -2,
        "budget": 7,
        "breakfast": False,
    }
    assert the_arguments(xml_call("book", nights="2.0", budget="1e3")) == {"nights": 2, "budget": 1000.0}
    assert the_arguments(xml_call("book", guest="{}", dates="[]")) == {"guest": {}, "dates": []}


def test_a_union_is_tried_in_schema_order() -> None:
    typed = {"note": None, "room": 12, "floor": "3"}  # null before string, integer before string, string first
    assert the_arguments(xml_call("book", note="null", room="12", floor="3")) == typed
    assert the_arguments(xml_call("book", note="quiet room", room="suite")) == {"note": "quiet room", "room": "suite"}


def test_values_that_fit_no_type_and_undeclared_names_stay_text() -> None:
    failed = xml_call("book", nights="three", budget="NaN", breakfast="yes", guest="[1]", dates="{'a': 1}")
    assert the_arguments(failed) == {
        "nights": "three",
        "budget": "NaN",  # no JSON number
        "breakfast": "yes",
        "guest": "[1]",  # an array is not an object
        "dates": "{'a': 1}",  # Python, not JSON
    }
    assert the_arguments(xml_call("book", pets="2", city="Rome")) == {"pets": "2", "city": "Rome"}
    assert the_arguments(xml_call("unknown_tool", count="2", flag="true")) == {"count": "2", "flag": "true"}
    assert plain(split_output(xml_call("book", nights="3"))) == [("book", {"nights": "3"})]  # no schemas given


def test_a_value_loses_exactly_one_newline_on_each_side() -> None:
    code = "\n\ndef f():\n    return 1\n\n"
    assert the_arguments(xml_call("book", city=code)) == {"city": code}
    inline = "<tool_call><function=book><parameter=city> Oslo </parameter><parameter=nights>4</parameter></function>"
    inline += "</tool_call>"
    assert the_arguments(inline) == {"city": " Oslo ", "nights": 4}
    assert the_arguments("<tool_call>\n<function=now>\n</function>\n</tool_call>") == {}


def test_a_value_may_hold_tag_like_text() -> None:
    value = "a <parameter=x> and </function> and <tool_call> inside"
    assert the_arguments(xml_call("book", city=value)) == {"city": value}


def test_several_calls_in_both_forms_with_reasoning_and_content() -> None:
    text = (
        "<think>\nTwo cities, so two calls.\n</think>\n\n"
        "Booking both.\n"
        + xml_call("book", city="Paris", nights="2")
        + "\n"
        + '<tool_call>\n{"name": "book", "arguments": {"city": "Rome", "nights": "5"}}\n</tool_call>\n'
        + xml_call("now")
    )
    assert split(text) == [
        Reasoning("Two cities, so two calls."),
        Content("Booking both."),
        ("book", {"city": "Paris", "nights": 2}),
        ("book", {"city": "Rome", "nights": "5"}),  # JSON arguments are taken as written
        ("now", {}),
    ]


# How the Qwen3.5 and Qwen3.6 chat templates write a call (their lines, reduced to the call).
TEMPLATE = """<tool_call>
<function={{ name }}>
{% for key, value in arguments.items() -%}
<parameter={{ key }}>
{% if qwen36 %}{{ value | string if value is string else value | tojson }}
{%- else %}{{ value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
{%- endif %}
</parameter>
{% endfor -%}
</function>
</tool_call>"""


@pytest.mark.parametrize("qwen36", [False, True])
def test_a_call_written_by_the_chat_template_reads_back(qwen36: bool) -> None:
    arguments = {
        "city": "São Paulo\n(two lines)",
        "nights": 3,
        "budget": 99.5,
        "breakfast": True,  # Qwen3.5 writes True, Qwen3.6 true
        "guest": {"name": "Ada", "tags": ["vip"]},
        "dates": ["2025-05-01"],
        "room": 12,
        "code": "007",
    }
    text = jinja2.Environment().from_string(TEMPLATE).render(name="book", arguments=arguments, qwen36=qwen36)
    assert split("Booking.\n" + text) == [Content("Booking."), ("book", arguments)]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no <function=
        "<tool_call>\n<function=book>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # unclosed parameter
        "<tool_call>\n<function=book>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # unclosed function
        "<tool_call>\n<function=book>\nParis\n</function>\n</tool_call>",  # text instead of a parameter
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\n<function=book\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=book>\n</function>\ntrailing words\n</tool_call>",
        "<tool_call>\nbook(city='Paris')\n</tool_call>",  # neither form
    ],
)
def test_a_malformed_call_stays_content_as_written(block: str) -> None:
    assert split(block) == [Content(block)]


def test_a_function_block_without_tool_call_tags_is_content() -> None:
    """As vLLM streams it: only `<tool_call>` opens a call (its non-streamed back-off aside)."""
    text = "Use this:\n<function=book>\n<parameter=city>\nParis\n</parameter>\n</function>"
    assert split(text) == [Content(text)]


def test_unclosed_call_at_the_end_is_content() -> None:
    text = "<tool_call>\n<function=book>\n<parameter=city>\nPar"
    assert split(text) == [Content(text)]


def test_without_tools_the_xml_stays_content() -> None:
    text = xml_call("book", nights="3")
    assert split_output(text, tools=False, schemas=SCHEMAS) == [Content(text)]


def test_tool_schemas_skip_entries_of_other_shapes() -> None:
    junk = [None, "book", {"type": "function"}, {"function": {"name": 3}}, {"function": {"name": "x", "parameters": 1}}]
    assert tool_schemas(junk) == {"x": {}}
    assert tool_schemas(None) == {}


STREAMED = (
    "<think>\nWhich city?\n</think>\n\nParis it is.\n"
    + xml_call("book", city="Paris", nights="3", breakfast="true", dates='["a", "b"]', note="null")
    + "\n"
    + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
    + "<tool_call>\n<function=book>\n<parameter=city>\nunclosed\n</function>\n</tool_call>\n"
    + "Done <tool_"
)


def streamed(chunks: list[str]) -> list[Any]:
    parser = OutputParser(schemas=SCHEMAS)
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.push(chunk)
    return plain(merge([*pieces, *parser.finish()]))


def test_streaming_split_at_every_boundary_gives_the_same_answer() -> None:
    whole = split(STREAMED)
    assert [type(p) for p in whole] == [Reasoning, Content, tuple, tuple, Content]
    for at in range(len(STREAMED) + 1):
        assert streamed([STREAMED[:at], STREAMED[at:]]) == whole, at
    assert streamed(list(STREAMED)) == whole


def test_streaming_in_random_chunks_gives_the_same_answer() -> None:
    whole = split(STREAMED)
    rng = random.Random(0)
    for _ in range(200):
        chunks, at = [], 0
        while at < len(STREAMED):
            step = rng.randint(1, 12)
            chunks.append(STREAMED[at : at + step])
            at += step
        assert streamed(chunks) == whole


def test_openai_and_ollama_carry_the_typed_arguments() -> None:
    completion = Completion(0, text=xml_call("book", city="Paris", nights="3"), finish_reason="stop")
    parse = {"reasoning": False, "tools": True, "schemas": SCHEMAS}
    choice = chat_choice(None, completion, logprobs=False, parse=parse)
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "book"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "nights": 3}  # a JSON string

    ollama = answer_fields(split_output(completion.text, schemas=SCHEMAS), chat=True)["message"]
    assert ollama["tool_calls"] == [{"function": {"name": "book", "arguments": {"city": "Paris", "nights": 3}}}]
