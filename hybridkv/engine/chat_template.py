"""Hugging Face chat templates, rendered as `transformers`' `apply_chat_template` renders them.

The template comes from `chat_template.jinja` (plus `additional_chat_templates/*.jinja`) in the
model directory, else from `chat_template` in `tokenizer_config.json` (a string, or a list of
`{"name", "template"}`). It runs in jinja2's immutable sandbox with the environment
`transformers` builds: trim_blocks, lstrip_blocks, loop controls, a `{% generation %}` tag
(rendered as plain text here), `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text and takes `indent`, and guarded `dict` / `namespace`.

Templates are untrusted code from the Hub: everything they see is first copied into plain JSON
types (dict, list, tuple, str, int, float, bool, None).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = frozenset({"system", "user", "assistant", "tool"})
# Standard special-token names transformers passes to every template (when set).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Older names for a message's reasoning; templates read `reasoning_content` (gpt-oss: `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One model's chat template(s) and the special-token strings they may refer to.

    `templates` maps names to template sources: "default", and optionally "tool_use", which is
    chosen when tools are given (as `transformers` does).
    """

    def __init__(self, templates: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None) -> None:
        if isinstance(templates, str):
            templates = {"default": templates}
        if not templates:
            raise ValueError("no chat template given")
        env = _environment()
        self._compiled = {name: env.from_string(source) for name, source in templates.items()}
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model directory's chat template, or None if it has none."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        templates: dict[str, str] = {}
        if (jinja_file := model_dir / "chat_template.jinja").is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = model_dir / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
        if not templates:  # separate files win over the config entry, as in transformers
            entry = config.get("chat_template")
            if isinstance(entry, str):
                templates["default"] = entry
            elif isinstance(entry, list):
                templates = {item["name"]: item["template"] for item in entry}
        if not templates:
            return None
        return cls(templates, _special_tokens(config, _read_json(model_dir / "special_tokens_map.json")))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate | None:
        """A GGUF file's `tokenizer.chat_template`, or None if it has none (see gguf_tokenizer.py)."""
        from hybridkv.engine.gguf_tokenizer import gguf_chat_templates, gguf_template_tokens

        templates = gguf_chat_templates(metadata)
        return cls(templates, gguf_template_tokens(metadata)) if templates else None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, exactly as `tokenizer.apply_chat_template(messages,
        tools=tools, add_generation_prompt=..., tokenize=False, **kwargs)` gives it (whose
        add_generation_prompt defaults to False: a prompt for generation is the usual case here).

        Messages are checked first (`ValueError` naming the message index and field). Keys whose
        value is None are dropped, and reasoning under an older name is also offered as
        `reasoning_content`, as `transformers` does. `kwargs` (e.g. `enable_thinking=False`)
        become template variables and override the special-token strings.
        """
        chat = _alias_reasoning([_checked_message(i, m) for i, m in enumerate(_check_list(messages))])
        if tools is not None:
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
        variables = {**self.special_tokens, **kwargs}
        return str(
            self._template(tools).render(
                messages=_plain(chat, "messages"),
                tools=_plain(tools, "tools"),
                documents=_plain(variables.pop("documents", None), "documents"),
                add_generation_prompt=add_generation_prompt,
                **_plain(variables, "kwargs"),
            )
        )

    def message_boundaries(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Character offsets in `render(messages, add_generation_prompt, tools, **kwargs)` where
        a message's rendered part ends, ascending and positive: for each k, the length of the
        render of `messages[:k]` without generation prompt, when that is a prefix of the full
        text. A prefix that renders differently in context (Qwen3 gives the last assistant turn a
        <think> block, earlier ones none) or that the template refuses (`raise_exception`) gives
        no offset, so the list may be shorter than `messages`. These are the points up to which
        a cached prompt stays valid when the conversation grows.
        """
        full = self.render(messages, add_generation_prompt, tools, **kwargs)
        offsets: list[int] = []
        for k in range(1, len(messages) + 1):
            try:
                prefix = self.render(messages[:k], False, tools, **kwargs)
            except jinja2.TemplateError:
                continue
            if full.startswith(prefix) and len(prefix) > (offsets[-1] if offsets else 0):
                offsets.append(len(prefix))
        return offsets

    def _template(self, tools: object) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ValueError(f"several chat templates and none named 'default': {sorted(self._compiled)}")


def _check_list(messages: object) -> Sequence[Any]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    return messages


def _checked_message(index: int, message: object) -> dict[str, Any]:
    """A copy of `message` without None values, after checking role and content."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}")
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
        raise ValueError(f"messages[{index}].tool_calls must be a list, on an assistant message")
    if not isinstance(content, str) and not (content is None and role == "assistant" and tool_calls):
        raise ValueError(
            f"messages[{index}].content must be a string (or None for an assistant message with "
            f"tool_calls), got {type(content).__name__}"
        )
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any, where: str) -> Any:
    """A deep copy of `value` in plain JSON types; anything else is a ValueError naming `where`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    for base in (bool, str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value)
    raise ValueError(f"{where} must hold only JSON values, got {type(value).__name__}")


def _special_tokens(config: Mapping[str, Any], legacy: Mapping[str, Any]) -> dict[str, str]:
    """Special-token strings the template may use, from tokenizer_config.json (standard names
    falling back to the older special_tokens_map.json): the standard names, any other
    `*_token` string and `extra_special_tokens` given as a dict, as transformers 5 collects them.
    A token is a string or an AddedToken dict with "content"."""
    tokens = {name: config.get(name, legacy.get(name)) for name in SPECIAL_TOKEN_NAMES}
    tokens.update({k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)})
    if isinstance(extra := config.get("extra_special_tokens"), dict):
        tokens.update(extra)
    texts = {name: value.get("content") if isinstance(value, dict) else value for name, value in tokens.items()}
    return {name: text for name, text in texts.items() if isinstance(text, str)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _DictBuilder:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without exposing the `dict` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja2's own filter: no HTML escaping, and keep non-ASCII text as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _Namespace
    return env
