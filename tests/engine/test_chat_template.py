"""Chat templates render exactly as transformers' `apply_chat_template` renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from hybridkv.engine.chat_template import ChatTemplate

# Qwen3's template (hybrid thinking, tools, reasoning kept only after the last user query).
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Leans on the environment itself: trim/lstrip blocks (no `-` here), loop controls, tojson
# options, dict(), special-token variables, the generation tag and raise_exception.
FEATURES_TEMPLATE = """\
{{ bos_token }}[{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}]
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    {% if loop.index > 4 %}
        {% break %}
    {% endif %}
    <{{ message.role }}> {{ message.content }}
    {% if message.role == 'assistant' %}
        {% generation %}{{ message.content | upper }}{% endgeneration %}
    {% endif %}
    {% if message.role not in ['user', 'assistant', 'system', 'tool'] %}
        {{ raise_exception('bad role ' + message.role) }}
    {% endif %}
{% endfor %}
{{ dict(a=1, b='é') | tojson(indent=2) }}
{{ messages[0] | tojson(sort_keys=true, separators=[',', ':']) }}
{% if tools %}{{ tools | tojson }}{% endif %}
{{ strftime_now('%Y-%m') }}
{% if add_generation_prompt %}<assistant>{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo du jour — 天气 <b>now</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system and multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "reasoning before and after the last query": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one", "reasoning_content": "think 1"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "<think>\nthink 2\n</think>\n\ntwo"},
    ],
    "tool calls and responses": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "content": "Paris: 18°C"},
        {"role": "tool", "content": "Lyon: 21°C"},
        {"role": "assistant", "content": "Paris 18°C, Lyon 21°C.", "reasoning": "compare"},
    ],
    "system only, tab and unicode": [
        {"role": "system", "content": "Réponds\ten français 🙂"},
        {"role": "user", "content": "<|im_start|> literal"},
    ],
}


def _model_dir(path: Path, tokenizer_config: dict[str, Any], template_file: str | None = None) -> Path:
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "hello": 4}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def _pair(model_dir: Path) -> tuple[ChatTemplate, Any]:
    from transformers import AutoTokenizer

    ours = ChatTemplate.from_dir(model_dir)
    assert ours is not None
    return ours, AutoTokenizer.from_pretrained(str(model_dir))


def _hf_render(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(hf.apply_chat_template(messages, tokenize=False, **kwargs))


QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTemplate, Any]:
    return _pair(_model_dir(tmp_path_factory.mktemp("qwen"), QWEN_TOKENS, QWEN3_TEMPLATE))


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
def test_qwen3_template_matches_transformers(
    qwen: tuple[ChatTemplate, Any], name: str, add_generation_prompt: bool, extra: dict[str, Any]
) -> None:
    ours, hf = qwen
    messages = CONVERSATIONS[name]
    kwargs = dict(add_generation_prompt=add_generation_prompt, **extra)
    assert ours.render(messages, **kwargs) == _hf_render(hf, messages, **kwargs)


def test_template_from_tokenizer_config_with_added_token_dicts(tmp_path: Path) -> None:
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
           "rstrip": False, "single_word": False, "special": True}  # fmt: skip
    config = {"chat_template": FEATURES_TEMPLATE, "bos_token": "<s>", "eos_token": eos, "pad_token": None}
    ours, hf = _pair(_model_dir(tmp_path, config))
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    for messages in CONVERSATIONS.values():
        for kwargs in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False, "tools": TOOLS},
            {"add_generation_prompt": True, "bos_token": "<B>"},  # kwargs override special tokens
        ):
            assert ours.render(messages, **kwargs) == _hf_render(hf, messages, **kwargs)


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "plain:{{ messages | length }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    ours, hf = _pair(_model_dir(tmp_path, {"chat_template": templates}))
    messages = CONVERSATIONS["one user turn"]
    assert ours.render(messages) == _hf_render(hf, messages) == "plain:1"
    assert ours.render(messages, tools=TOOLS) == _hf_render(hf, messages, tools=TOOLS) == "tools:1"


def test_jinja_file_wins_over_the_config_entry(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, {"chat_template": "from config"}, template_file="from file")
    ours, hf = _pair(model_dir)
    messages = CONVERSATIONS["one user turn"]
    assert ours.render(messages) == _hf_render(hf, messages) == "from file"


def test_no_template_gives_none(tmp_path: Path) -> None:
    assert ChatTemplate.from_dir(_model_dir(tmp_path, {})) is None


def test_raise_exception_surfaces_as_a_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(jinja2.TemplateError, match="only user turns"):
        template.render(CONVERSATIONS["one user turn"])


def test_the_sandbox_refuses_private_attributes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(CONVERSATIONS["one user turn"])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.__class__.__init__.__globals__ }}").render(CONVERSATIONS["one user turn"])


@pytest.mark.parametrize(
    "messages, where",
    [
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None, "tool_calls": [{}]}], r"messages\[0\]\.tool_calls"),
        ([{"role": "assistant", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a", "extra": {1, 2}}], r"messages\[0\]\['extra'\]"),
    ],
)
def test_malformed_messages_are_rejected_naming_index_and_field(messages: Any, where: str) -> None:
    with pytest.raises(ValueError, match=where):
        ChatTemplate(QWEN3_TEMPLATE).render(messages)


def test_renders_do_not_mutate_the_callers_messages(qwen: tuple[ChatTemplate, Any]) -> None:
    messages = json.loads(json.dumps(CONVERSATIONS["tool calls and responses"]))
    qwen[0].render(messages, tools=TOOLS)
    assert messages == CONVERSATIONS["tool calls and responses"]


def _hf_boundaries(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    full = _hf_render(hf, messages, add_generation_prompt=True, **kwargs)
    prefixes = [
        _hf_render(hf, messages[:k], add_generation_prompt=False, **kwargs) for k in range(1, len(messages) + 1)
    ]
    return [len(p) for p in prefixes if full.startswith(p)]


def test_message_boundaries_end_each_turn() -> None:
    chatml = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = CONVERSATIONS["system and multi-turn"]
    full = chatml.render(messages)
    offsets = chatml.message_boundaries(messages)
    ends = [full.index(m["content"]) + len(m["content"] + "<|im_end|>\n") for m in messages]
    assert offsets == ends
    assert full[offsets[-1] :] == "<|im_start|>assistant\n"  # only the generation prompt follows
    assert chatml.message_boundaries(messages, add_generation_prompt=False)[-1] == len(
        chatml.render(messages, add_generation_prompt=False)
    )


def test_a_turn_rendered_differently_in_context_has_no_boundary(qwen: tuple[ChatTemplate, Any]) -> None:
    ours, hf = qwen
    # As the last turn, an assistant message gets a <think> block; once a user turn follows,
    # Qwen3 renders it without one, so the render up to it is not a prefix of the whole.
    messages = CONVERSATIONS["system and multi-turn"]
    full = ours.render(messages)
    offsets = ours.message_boundaries(messages)
    assert offsets == _hf_boundaries(hf, messages)
    assert [full[:end].rsplit("<|im_start|>", 1)[1] for end in offsets] == [
        "system\nYou are terse.<|im_end|>\n",
        "user\n2+2?<|im_end|>\n",
        "user\nand 3+3?<|im_end|>\n",
    ]
    assert "<think>" in ours.render(messages[:3], add_generation_prompt=False)
    assert "<think>" not in full


def test_model_specific_special_tokens_reach_the_template(tmp_path: Path) -> None:
    config = {
        "chat_template": "{{ image_token }}|{{ audio_token }}|{{ eos_token }}",
        "image_token": "<img>",
        "extra_special_tokens": {"audio_token": "<aud>"},
        "eos_token": "<|im_end|>",
    }
    ours, hf = _pair(_model_dir(tmp_path, config))
    messages = CONVERSATIONS["one user turn"]
    assert ours.render(messages) == _hf_render(hf, messages) == "<img>|<aud>|<|im_end|>"
