"""Structured output and forced tool calls: the request fields that constrain an answer, read into
one `Grammar` over the whole output, written in the model's own formats.

    OpenAI  response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
            tool_choice "required" | {"type": "function", "function": {"name": ...}}
            parallel_tool_calls false: at most one call
    Ollama  format "json" | {schema}

    output  = [thinking] body          thinking: free text up to </think> when the prompt opened it
    body    = json                     response_format / format, no tool may be called
            | calls                    tool_choice "required" or a named function
            | json | calls             response_format with tools the model may call (auto)
            | text [call]              parallel_tool_calls false with tools (auto)
    calls   = call ("\\n" call)*       a single call when parallel_tool_calls is false
    call    = <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>          JSON (Hermes; the default model)
            | <tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>   XML (Qwen3.5)

Thinking: for a prompt that opened a think block (Qwen3.5 with thinking on) the grammar starts
after `</think>`: the reasoning stays free and the answer after it is constrained, so a client
keeps the thinking it asked for (turn it off with `enable_thinking: false` / `think: false`).

The XML format writes each argument as text read back by its schema's first type (see
`tool_calls.coerce`): a string parameter's value is free text (or one of its `enum`), any other
is JSON valid against its schema. What that format cannot say (a `pattern` on a string, a string
type listed after another type, a `$ref` parameter) is a 400 naming the keyword, as is any JSON
Schema keyword llguidance cannot enforce. Both formats' calls parse back with `tool_calls.parse_call`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hybridkv.engine.grammar import Grammar, GrammarError, Grammars, json_value, literal
from hybridkv.server.fields import ApiError, Fields, bad
from hybridkv.server.tool_calls import END_PARAMETER, FUNCTION, schema_types

ToolStyle = Literal["json", "xml"]
TOOL, END_TOOL = "<tool_call>", "</tool_call>"
# What XML calls cannot hold a value to: keywords restricting strings (text is written as is; its
# enum, const and a first string alternative of anyOf are enforced), and keywords restricting the
# arguments object beyond its declared properties (only those are written, each at most once).
_TEXT_UNENFORCEABLE = frozenset(
    {"pattern", "format", "minLength", "maxLength", "allOf", "oneOf", "not", "if", "then", "else", "$dynamicRef"}
)
_ARGUMENTS_UNENFORCEABLE = frozenset(
    {"minProperties", "maxProperties", "patternProperties", "propertyNames", "dependentRequired"}
    | {"dependentSchemas", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"}
    | {"$ref", "$dynamicRef"}
)
_MAX_MESSAGE = 400


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]
    where: str  # the request field it came from, for errors


@dataclass(frozen=True)
class Constraint:
    """What an answer must be. `schema`: its content is JSON valid against it (`where` names
    the field). `calls`: whether the model may ("auto") or must ("required") call one of `tools`;
    `parallel` False allows at most one call."""

    schema: Mapping[str, Any] | None = None
    where: str = ""
    tools: tuple[Tool, ...] = ()
    calls: Literal["none", "auto", "required"] = "none"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Does it constrain anything? (auto calls with parallel calls allowed and no schema do not.)"""
        return self.schema is not None or self.calls == "required" or (self.calls == "auto" and not self.parallel)

    def parser_options(self) -> dict[str, bool]:
        """OutputParser options for the answer: no think block opens in a constrained answer, and
        tool-call tags are read only where calls may be (a JSON string may hold '<tool_call>')."""
        return {"think": False, "tools": self.calls != "none"}


# -- reading the request -----------------------------------------------------------------------


def openai_constraint(body: Fields, tools: Sequence[Any] | None) -> Constraint:
    """`response_format`, `tool_choice` and `parallel_tool_calls` of a chat request."""
    schema, where = _response_format(body.get("response_format"))
    choice = body.get("tool_choice")
    parallel = body.boolean("parallel_tool_calls") is not False
    if choice in (None, "auto", "none") and (choice == "none" or not tools):
        return Constraint(schema, where, calls="none")
    if not tools:
        raise bad("tool_choice", "needs tools to choose from")
    if choice in (None, "auto"):
        if schema is None and parallel:  # nothing to enforce: tools stay as lenient as ever
            return Constraint(calls="auto")
        return Constraint(schema, where, _tools(tools), "auto", parallel)
    declared = _tools(tools)
    if choice == "required":
        return Constraint(schema, where, declared, "required", parallel)
    if isinstance(choice, Mapping):
        fields = Fields(choice, "tool_choice")
        if fields.string("type", required=True) != "function":
            raise bad("tool_choice.type", 'only "function" is supported')
        function = fields.mapping("function")
        if function is None:
            raise bad("tool_choice.function", "is required")
        name = function.string("name", required=True)
        function.finish()
        fields.finish()
        chosen = tuple(t for t in declared if t.name == name)
        if not chosen:
            raise bad("tool_choice.function.name", f"no tool named {name!r} in tools")
        return Constraint(schema, where, chosen, "required", parallel)
    raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _response_format(value: object) -> tuple[Mapping[str, Any] | None, str]:
    if value is None:
        return None, ""
    fields = Fields(value, "response_format")
    kind = fields.string("type", required=True)
    if kind == "text":
        fields.finish()
        return None, ""
    if kind == "json_object":
        fields.finish()
        return {"type": "object"}, "response_format"
    if kind != "json_schema":
        raise bad("response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = fields.mapping("json_schema")
    if spec is None:
        raise bad("response_format.json_schema", "is required")
    fields.finish()
    spec.string("name")
    spec.string("description")
    strict = bool(spec.boolean("strict"))
    schema = spec.get("schema")
    spec.finish()
    where = "response_format.json_schema.schema"
    if schema is None:
        return {"type": "object"}, where
    if not isinstance(schema, Mapping):
        raise bad(where, "must be a JSON Schema object")
    return (closed(schema) if strict else schema), where


def ollama_constraint(value: object) -> Constraint:
    """Ollama's `format`: "json" (any JSON object, as Ollama's own JSON grammar) or a JSON schema."""
    if value is None or value == "":
        return Constraint()
    if value == "json":
        return Constraint({"type": "object"}, "format")
    if isinstance(value, Mapping):
        return Constraint(value, "format")
    raise bad("format", 'must be "json" or a JSON schema object')


def _tools(tools: Sequence[Any]) -> tuple[Tool, ...]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad(f"{where}.name", "is required: a tool the model may call needs a name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise bad(f"{where}.parameters", "must be a JSON Schema object")
        if parameters.get("type", "object") != "object":
            raise bad(f"{where}.parameters.type", 'must be "object": arguments are an object')
        out.append(Tool(function["name"], {**parameters, "type": "object"}, f"{where}.parameters"))
    return tuple(out)


def closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` as OpenAI's strict mode reads it: an object without `additionalProperties` takes
    no property beyond its `properties` (an allOf's parts are left alone: each sees only some)."""
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed(v) if isinstance(v, Mapping) else v for k, v in out[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), Mapping):
            out[key] = closed(out[key])
    for key in ("prefixItems", "anyOf"):
        if isinstance(out.get(key), list):
            out[key] = [closed(v) if isinstance(v, Mapping) else v for v in out[key]]
    return out


# -- the grammar -------------------------------------------------------------------------------


def build(constraint: Constraint, grammars: Grammars, style: ToolStyle, thinking: bool) -> Grammar | None:
    """The grammar of the whole output (None when nothing is constrained), checked: a part the
    engine cannot enforce is a 400 naming its field."""
    if not constraint.active:
        return None
    try:
        return _build(constraint, grammars, style, thinking)
    except GrammarError as e:
        raise ApiError(400, f"the constrained output cannot be enforced: {_short(e)}") from None


def _build(c: Constraint, grammars: Grammars, style: ToolStyle, thinking: bool) -> Grammar:
    rules: list[str] = []
    if c.schema is not None:
        _check(grammars, json_value(c.schema), c.where)
    if c.calls == "none" or not c.tools:
        body = json_value(c.schema or {})
    else:
        tag, end = grammars.tag(TOOL), grammars.tag(END_TOOL)
        rest = _call_rest(c.tools, grammars, style, end, rules)
        rules.append(f"call: {tag} call_rest")
        calls = "call" if not c.parallel else 'call ("\\n" call)*'
        if c.schema is not None:
            body = f"{json_value(c.schema)} | {calls}"
        elif c.calls == "required":
            body = calls
        elif tag == TOOL:  # auto, one call at most, the tag a special token: text cannot contain it
            body = "/(.|\\n)*/ call?"
        else:  # the tag is text: free text without it, or text up to the first tag and one call
            body = "TEXT | call_head call_rest"
            rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(TOOL)}(?s:.*)/")
            rules.append(f"call_head[lazy]: /(?s:.*){_regex(TOOL)}/")
        rules.append(f"call_rest: {rest}")
    start = f"start: thinking ({body})" if thinking else f"start: {body}"
    if thinking:
        rules.append(grammars.thinking_rule())
    grammar = Grammar("\n".join([start, *rules]) + "\n")
    grammars.check(grammar)
    return grammar


def _call_rest(tools: Sequence[Tool], grammars: Grammars, style: ToolStyle, end: str, rules: list[str]) -> str:
    """Lark for a call after its opening tag, up to and with its closing tag."""
    if style == "json":
        for tool in tools:
            _check(grammars, json_value(tool.parameters), tool.where)
        alternatives = [_json_call(i, tool) for i, tool in enumerate(tools)]
        call = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        defs = {f"arguments_{i}": _relocated(tool.parameters, f"#/$defs/arguments_{i}") for i, tool in enumerate(tools)}
        return f'"\\n" {json_value({**call, "$defs": defs})} "\\n" {end}'
    return _xml_call_rest(tools, grammars, end, rules)


def _xml_call_rest(tools: Sequence[Tool], grammars: Grammars, end: str, rules: list[str]) -> str:
    # Text that cannot close the parameter or the call, then the closing: one terminal, so that
    # the lexer never has to take back text it read as the value.
    closing = literal("\n" + END_PARAMETER + "\n")
    rules.append(f"VALUE_TEXT: (/(?s:.*)/ & ~/(?s:.*)({_regex(END_PARAMETER)}|{_regex(END_TOOL)})(?s:.*)/) {closing}")
    names = []
    for i, tool in enumerate(tools):
        _check_name(tool.name, f"{tool.where.removesuffix('.parameters')}.name")
        parts = [literal(f"\n{FUNCTION}{tool.name}>\n")]
        for k, (key, schema, required) in enumerate(_xml_parameters(tool)):
            value = _xml_value(schema, tool, key, grammars)
            rules.append(f"p_{i}_{k}: {literal(f'<parameter={key}>' + chr(10))} {value}")
            parts.append(f"p_{i}_{k}" + ("" if required else "?"))
        parts.append(f'"</function>\\n" {end}')
        rules.append(f"call_{i}: {' '.join(parts)}")
        names.append(f"call_{i}")
    return " | ".join(names) if len(names) == 1 else "(" + " | ".join(names) + ")"


def _json_call(index: int, tool: Tool) -> dict[str, Any]:
    """The Hermes call object `{"name": ..., "arguments": ...}` of one tool."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": {"$ref": f"#/$defs/arguments_{index}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _relocated(schema: Any, root: str) -> Any:
    """`schema` with its local `$ref`s ("#/...") pointing below `root`, where it is placed."""
    if isinstance(schema, Mapping):
        out = {k: _relocated(v, root) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(schema, list):
        return [_relocated(v, root) for v in schema]
    return schema


def _xml_parameters(tool: Tool) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, schema, required) of each declared parameter, in the order the schema lists them."""
    for keyword in tool.parameters:
        if keyword in _ARGUMENTS_UNENFORCEABLE:
            raise bad(f"{tool.where}.{keyword}", "cannot be enforced on arguments in this model's XML tool-call format")
    properties = tool.parameters.get("properties") or {}
    if not isinstance(properties, Mapping):
        raise bad(f"{tool.where}.properties", "must be an object")
    required = tool.parameters.get("required") or []
    if not isinstance(required, list) or any(key not in properties for key in required):
        raise bad(f"{tool.where}.required", "must list declared properties: only those can be written in XML calls")
    out = []
    for key, schema in properties.items():
        _check_name(key, f"{tool.where}.properties")
        if not isinstance(schema, Mapping):
            raise bad(f"{tool.where}.properties.{key}", "must be a JSON Schema object")
        out.append((key, schema, key in required))
    return out


def _xml_value(schema: Mapping[str, Any], tool: Tool, key: str, grammars: Grammars) -> str:
    """Lark for one XML parameter value and its closing `\n</parameter>\n`: text for a string
    (read back as the text), else JSON valid against the schema (read back as that JSON)."""
    where = f"{tool.where}.properties.{key}"
    if "$ref" in schema:
        raise bad(f"{where}.$ref", "is not supported in this model's XML tool-call format: inline the schema")
    kinds = schema_types(schema)
    if kinds and kinds[0] != "string":
        if "string" in kinds:
            raise bad(where, "a value is read as its first listed type in this model's XML format: list string first")
        document = {"$defs": {"parameters": _relocated(tool.parameters, "#/$defs/parameters")}}
        value = json_value({**document, "$ref": f"#/$defs/parameters/properties/{_pointer(key)}"})
        _check(grammars, value, where)
        return f"{value} {literal(chr(10) + END_PARAMETER + chr(10))}"
    return _xml_text(schema, where)


def _xml_text(schema: Mapping[str, Any], where: str) -> str:
    """A string value: any text (that cannot close the parameter or the call), or one of its
    enum / const strings; nothing else can be enforced on text written as is."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    for keyword in schema:
        if keyword in _TEXT_UNENFORCEABLE:
            raise bad(f"{where}.{keyword}", "cannot be enforced on a string in this model's XML tool-call format")
    if "anyOf" in schema:  # read as its first alternative, a string: that one must hold
        first = schema["anyOf"][0] if isinstance(schema["anyOf"], list) and schema["anyOf"] else None
        if "type" in schema or not isinstance(first, Mapping) or schema_types(first)[:1] != ["string"]:
            raise bad(f"{where}.anyOf", "in this model's XML format the first alternative must be a string")
        return _xml_text(first, f"{where}.anyOf[0]")
    if choices is None:
        return "VALUE_TEXT"
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise bad(f"{where}.enum", "must list strings in this model's XML tool-call format")
    if any(END_PARAMETER in c or END_TOOL in c for c in choices):
        raise bad(f"{where}.enum", "a value cannot contain </parameter> or </tool_call>")
    return "(" + " | ".join(literal(c) for c in choices) + f") {literal(chr(10) + END_PARAMETER + chr(10))}"


def _check(grammars: Grammars, value: str, where: str) -> None:
    try:
        grammars.check(Grammar(f"start: {value}\n"))
    except GrammarError as e:
        raise bad(where, f"cannot be enforced: {_short(e)}") from None


def _check_name(name: str, where: str) -> None:
    if not name or any(c in name for c in "<>\n"):
        raise bad(where, f"{name!r} cannot be written in this model's XML tool-call format (no <, > or newline)")


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/-" else c for c in text)


def _short(error: Exception) -> str:
    message = str(error)
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE] + "…"
