"""Qwen3.5 and Qwen3.6's official chat templates render through our ChatTemplate exactly as
through transformers' apply_chat_template: thinking on and off, tools, tool calls and their
results, history whose old reasoning is dropped, and 3.6's preserve_thinking."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from qwen35_tokenizer import DATA, write_qwen35_tokenizer

from hybridkv.engine.chat_template import ChatTemplate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are terse."}
CALL = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "The user wants the weather; call the tool.",
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "units": ["C", "F"]}},
        },
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "flag": True}}},
    ],
}
RESULTS = [{"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"temp": 17}'}]
HISTORY = [
    SYSTEM,
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
    {"role": "user", "content": "And 3+3?"},
]

CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = {
    "thinking by default": ([SYSTEM, {"role": "user", "content": "Hello"}], None, {}),
    "thinking off": ([SYSTEM, {"role": "user", "content": "Hello"}], None, {"enable_thinking": False}),
    "thinking on": ([{"role": "user", "content": "Hello"}], None, {"enable_thinking": True}),
    "tools": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"}], TOOLS, {}),
    "tools, no system": ([{"role": "user", "content": "Weather in Paris?"}], TOOLS, {"enable_thinking": False}),
    "tool calls and results": ([SYSTEM, {"role": "user", "content": "Weather?"}, CALL, *RESULTS], TOOLS, {}),
    "history": (HISTORY, None, {}),
    "history, preserve_thinking": (HISTORY, None, {"preserve_thinking": True}),
    "tool chain, preserve_thinking": (
        [{"role": "user", "content": "Weather?"}, CALL, *RESULTS],
        TOOLS,
        {"preserve_thinking": True},
    ),
}


@pytest.fixture(scope="module", params=["3.5", "3.6"])
def templates(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTemplate, Any]:
    from transformers import AutoTokenizer

    path = write_qwen35_tokenizer(tmp_path_factory.mktemp(f"qwen{request.param}"), template=request.param)
    template = ChatTemplate.from_dir(path)
    assert template is not None
    return template, AutoTokenizer.from_pretrained(path)


def render_both(
    templates: tuple[ChatTemplate, Any], messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any
) -> str:
    ours, hf = templates
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    got = ours.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
    assert got == want
    return got


@pytest.mark.parametrize("case", CASES)
def test_renders_as_transformers(templates: tuple[ChatTemplate, Any], case: str) -> None:
    messages, tools, kwargs = CASES[case]
    render_both(templates, messages, tools, **kwargs)


def test_thinking_is_on_unless_turned_off(templates: tuple[ChatTemplate, Any]) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    assert render_both(templates, messages).endswith("<|im_start|>assistant\n<think>\n")
    off = render_both(templates, messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_come_before_the_system_text_with_xml_call_instructions(templates: tuple[ChatTemplate, Any]) -> None:
    text = render_both(templates, [SYSTEM, {"role": "user", "content": "Weather?"}], TOOLS)
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert '"name": "get_weather"' in system and "<function=example_function_name>" in system
    assert system.endswith("</IMPORTANT>\n\nYou are terse.")


def test_tool_calls_render_as_xml_and_results_as_one_user_turn(templates: tuple[ChatTemplate, Any]) -> None:
    text = render_both(templates, [{"role": "user", "content": "Weather?"}, CALL, *RESULTS], TOOLS)
    assert (
        "<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n" in text
    )
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n" in text
    assert '<parameter=units>\n["C", "F"]\n</parameter>' in text
    assert text.count("<|im_start|>user") == 2  # the question, then both results together
    assert '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"temp": 17}\n</tool_response>' in text


def test_history_loses_its_reasoning(templates: tuple[ChatTemplate, Any]) -> None:
    text = render_both(templates, HISTORY)
    assert "Greet back." not in text and "Simple sum." not in text
    assert "<|im_start|>assistant\nHello!<|im_end|>\n" in text and "<|im_start|>assistant\n4<|im_end|>\n" in text


def test_qwen36_preserve_thinking_keeps_it(templates: tuple[ChatTemplate, Any]) -> None:
    ours, _ = templates
    text = render_both(templates, HISTORY, preserve_thinking=True)
    if "preserve_thinking" not in ours.templates["default"]:  # Qwen3.5 has no such switch
        assert "Greet back." not in text
        return
    assert "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n" in text
    assert "<|im_start|>assistant\n<think>\nSimple sum.\n</think>\n\n4<|im_end|>\n" in text


@pytest.mark.parametrize(
    ("name", "sha256"),
    [
        ("qwen3_5_chat_template.jinja", "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"),
        ("qwen3_6_chat_template.jinja", "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"),
    ],
)
def test_templates_are_the_official_files(name: str, sha256: str) -> None:
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == sha256  # see tests/data/README.md
