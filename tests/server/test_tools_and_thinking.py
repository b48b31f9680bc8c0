"""`<think>` blocks become reasoning, `<tool_call>` blocks tool calls, in both APIs' shapes, streamed
or not; a model without a chat template but with ChatML tokens gets a ChatML template that
renders tools; tools sent by a client reach the prompt."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from served import MODEL, Served, make_llm, start, stop

from hybridkv.engine.request import Completion
from hybridkv.server.chatml import CHATML_WITH_TOOLS
from hybridkv.server.ollama import answer_fields
from hybridkv.server.openai import chat_choice
from hybridkv.server.parsing import Content, OutputParser, Reasoning, ToolCall, merge, split_output

ANSWER = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    "Let me check. <b>bold</b> stays.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    "<tool_call>\nnot json\n</tool_call>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_think_and_tool_call_blocks_are_split_out() -> None:
    [reasoning, content, call, broken] = split_output(ANSWER)
    assert reasoning == Reasoning("The user wants the weather.")
    assert content == Content("Let me check. <b>bold</b> stays.")
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("get_weather", {"city": "Paris", "days": 2})
    assert broken == Content("<tool_call>\nnot json\n</tool_call>")  # not a call: left as the model wrote it


def test_streaming_in_any_pieces_gives_the_same_split() -> None:
    whole = split_output(ANSWER)
    rng = random.Random(0)
    for _ in range(50):
        parser, pieces, at = OutputParser(), [], 0
        while at < len(ANSWER):
            step = rng.randint(1, 6)
            pieces += parser.push(ANSWER[at : at + step])
            at += step
        pieces += parser.finish()
        merged = merge(pieces)
        assert [(type(p), getattr(p, "text", getattr(p, "name", None))) for p in merged] == [
            (type(p), getattr(p, "text", getattr(p, "name", None))) for p in whole
        ]


def test_plain_text_comes_out_unchanged() -> None:
    text = " spaces, <tags, a lone <think without end and </tool_call> alone  \n"
    assert split_output(text, tools=True) == [Content(text)]
    assert split_output("<tool_call>{}", tools=False) == [Content("<tool_call>{}")]
    assert split_output("thought</think>answer", reasoning=True) == [Reasoning("thought"), Content("answer")]
    assert split_output("<think>unfinished") == [Reasoning("unfinished")]


def test_openai_and_ollama_shapes_of_a_tool_call() -> None:
    completion = Completion(0, text=ANSWER.replace("<tool_call>\nnot json\n</tool_call>", ""), finish_reason="stop")
    choice = chat_choice(None, completion, logprobs=False, parse={"reasoning": False, "tools": True})
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants the weather."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}  # a JSON string

    ollama = answer_fields(split_output(completion.text), chat=True)["message"]
    assert ollama["thinking"] == "The user wants the weather."
    assert ollama["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]


@pytest.fixture(scope="module")
def templateless(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The chat model without its chat template (like the default model)."""
    bare = tmp_path_factory.mktemp("templateless")
    for path in model_dir.iterdir():
        shutil.copy(path, bare / path.name)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    served, thread = start(make_llm(bare, max_num_seqs=2))
    yield served
    stop(served, thread)


def test_a_model_without_template_gets_chatml_with_tools(templateless: Served) -> None:
    assert templateless.llm.template is not None
    assert templateless.llm.template.templates["default"] == CHATML_WITH_TOOLS
    client = templateless.openai()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    tooled = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, tools=TOOLS)  # type: ignore[arg-type]
    none = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
    )
    assert plain.usage is not None and tooled.usage is not None and none.usage is not None
    rendered = templateless.llm.template.render(messages, tools=TOOLS)
    assert "get_weather" in rendered and tooled.usage.prompt_tokens == len(templateless.llm.encode(rendered))
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < tooled.usage.prompt_tokens


def test_a_tool_round_trip_renders_through_both_apis(templateless: Served) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = templateless.openai().chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=2,
    )
    ollama_messages = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    same = templateless.ollama().chat(model=MODEL, messages=ollama_messages, tools=TOOLS, options={"num_predict": 2})
    assert out.usage is not None and same.prompt_eval_count == out.usage.prompt_tokens
