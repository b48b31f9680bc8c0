"""Short JSON schemas for structured-output tests: each kind of constraint once (types, bounds,
enums, patterns, formats, $ref, anyOf with null, closed and open objects), small enough that a
tiny model's answer fits in a few dozen tokens."""

from __future__ import annotations

import calendar
import json
import re
from typing import Any

import jsonschema

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        },
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    {"enum": ["red", "green", "blue", 7, None]},
    {
        "type": "object",
        "properties": {"point": {"$ref": "#/$defs/point"}},
        "required": ["point"],
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "number", "maximum": 10}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
    },
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "count": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
        },
        "required": ["tags", "count"],
    },
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
]


def check_answer(text: str, schema: dict[str, Any]) -> None:
    """`text` is JSON valid against `schema`, formats checked too."""
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date")
def _full_date(value: object) -> bool:
    """RFC 3339 full-date, as JSON Schema defines "date" (jsonschema's own check parses it with
    Python's `date`, which has no year 0000)."""
    match = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", value) if isinstance(value, str) else None
    if match is None:
        return not isinstance(value, str)
    year, month, day = map(int, match.groups())
    days = [31, 29 if calendar.isleap(year) else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]
