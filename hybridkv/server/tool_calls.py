"""The body of a `<tool_call>` block as a function name and its arguments, in either form:

    {"name": "get_weather", "arguments": {"city": "Paris"}}        Qwen3, Qwen3-Next: JSON

    <function=get_weather>                                          Qwen3-Coder, Qwen3.5/3.6: XML
    <parameter=city>
    Paris
    </parameter>
    </function>

XML parameter values are text; each is read as the JSON type its parameter's schema names (the
request's `tools[].function.parameters.properties`), trying a union's types in schema order. A
string parameter, a parameter or tool the request did not declare, and a value that fits none of
the types keep the text as written (less the one newline the template puts on each side).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"

ToolSchemas = Mapping[str, Mapping[str, Any]]  # function name -> its parameters' JSON schema


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    """The parameters schema of each function in a request's `tools` (OpenAI's and Ollama's
    shape: `{"type": "function", "function": {"name": …, "parameters": {…}}}`); entries of any
    other shape are skipped, never refused."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return schemas


def parse_call(body: str, schemas: ToolSchemas | None = None) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a tool-call body in the JSON or the XML form; None when it is neither."""
    if body.lstrip().startswith(FUNCTION):
        return _xml_call(body.strip(), schemas or {})
    return _json_call(body)


def _json_call(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return data["name"], arguments


def _xml_call(text: str, schemas: ToolSchemas) -> tuple[str, dict[str, Any]] | None:
    """`<function=NAME>` then only `<parameter=KEY>VALUE</parameter>` blocks, then `</function>`;
    anything else (an unclosed tag, stray text between blocks) is not a call."""
    if not (text.startswith(FUNCTION) and text.endswith(END_FUNCTION)):
        return None
    name, closed, rest = text[len(FUNCTION) : -len(END_FUNCTION)].partition(">")
    name = name.strip()
    if not closed or not _is_name(name):
        return None
    schema = schemas.get(name)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        properties = {}
    arguments: dict[str, Any] = {}
    rest = rest.lstrip()
    while rest:
        if not rest.startswith(PARAMETER):
            return None
        key, closed, rest = rest[len(PARAMETER) :].partition(">")
        value, ended, rest = rest.partition(END_PARAMETER)
        key = key.strip()
        if not closed or not ended or not _is_name(key):
            return None
        arguments[key] = coerce(_unwrap(value), properties.get(key))
        rest = rest.lstrip()
    return name, arguments


def _is_name(text: str) -> bool:
    return bool(text) and not any(c in text for c in "<\n")


def _unwrap(value: str) -> str:
    """The value less one leading and one trailing newline: the template writes it on its own lines."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


# -- schema types ------------------------------------------------------------------------------


def coerce(text: str, schema: object) -> Any:
    """`text` read as the first type its schema allows that fits it; the text itself if none does
    (no schema, no type, or a value that is not valid for any of them)."""
    for kind in schema_types(schema):
        fits, value = _read(kind, text)
        if fits:
            return value
    return text


def schema_types(schema: object) -> list[str]:
    """The JSON types a schema allows, in the order it lists them: its `type` (a name or a list
    of names), then the alternatives of `anyOf` and `oneOf`, depth first."""
    kinds: list[str] = []
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, Mapping):
            continue
        kind = node.get("type")
        names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
        kinds += [name for name in names if isinstance(name, str)]
        alternatives: list[object] = []
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                alternatives += node[key]
        todo += reversed(alternatives)  # the first alternative is taken next
    return kinds


def _read(kind: str, text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is a valid `kind`, else (False, None)."""
    if kind == "string":
        return True, text
    word = text.strip().lower()
    if kind == "null":
        return word == "null", None
    if kind == "boolean":
        return word in ("true", "false"), word == "true"
    fits, value = _json(text)
    if not fits:
        return False, None
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():  # 1e3 and 2.0 are integers to JSON Schema
            value = int(value)
        return isinstance(value, int) and not isinstance(value, bool), value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    expected = {"number": number, "object": isinstance(value, dict), "array": isinstance(value, list)}
    return expected.get(kind, False), value


def _json(text: str) -> tuple[bool, Any]:
    """Strict JSON: no NaN or infinite numbers, which would not survive as JSON in the answer."""
    try:
        return True, json.loads(text, parse_constant=_not_finite, parse_float=_finite)
    except (ValueError, RecursionError):
        return False, None


def _finite(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _not_finite(text)  # 1e999


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")
