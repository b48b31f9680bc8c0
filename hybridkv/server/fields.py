"""Reading a JSON request body field by field: every type or value error is an `ApiError` naming
the field, and every field nobody read is refused unless it is known to be harmless. Error bodies
in the style of the API called."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

_MISSING = object()


class ApiError(Exception):
    """An HTTP error answer: status, a message a user can act on, and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error answer's body in the style of the API at `path`: Ollama's under /api/, OpenAI's elsewhere."""
    if path.startswith("/api/"):
        return {"error": message}
    kind = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(status)
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
    code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else None}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field)


class Fields:
    """A JSON object being read. `string`, `integer`, ... check and return one field (None when absent or null);
    `finish(harmless)` refuses any field that was not read and is not in `harmless`."""

    def __init__(self, data: object, where: str = "") -> None:
        if not isinstance(data, Mapping):
            raise bad(where or "body", f"must be a JSON object, got {_kind(data)}")
        self.data = data
        self.where = where
        self.read: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        self.read.add(key)
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def string(self, key: str, required: bool = False) -> str | None:
        value = self._value(key, required)
        if value is not None and not isinstance(value, str):
            raise bad(self.name(key), f"must be a string, got {_kind(value)}")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad(self.name(key), f"must be true or false, got {_kind(value)}")
        return value

    def integer(self, key: str, low: int | None = None, high: int | None = None) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some clients send 5.0
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad(self.name(key), f"must be an integer, got {_kind(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad(self.name(key), f"must be {_bounds(low, high)}, got {value}")
        return value

    def number(self, key: str, low: float | None = None, high: float | None = None) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise bad(self.name(key), f"must be a finite number, got {_kind(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad(self.name(key), f"must be {_bounds(low, high)}, got {value}")
        return float(value)

    def array(self, key: str, required: bool = False) -> list[Any] | None:
        value = self._value(key, required)
        if value is not None and not isinstance(value, list):
            raise bad(self.name(key), f"must be a list, got {_kind(value)}")
        return value

    def mapping(self, key: str) -> Fields | None:
        value = self.get(key)
        return None if value is None else Fields(value, self.name(key))

    def stop(self, key: str) -> tuple[str, ...]:
        """A string or a list of strings."""
        value = self.get(key)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad(self.name(key), f"must be a string or a list of strings, got {_kind(value)}")
        return tuple(s for s in items if s)

    def refuse(self, key: str, why: str = "is not supported", allowed: Collection[object] = ()) -> None:
        """Refuse `key` unless it is absent, null or one of `allowed` (values that change nothing)."""
        value = self.get(key)
        if value is not None and value not in allowed:
            raise bad(self.name(key), why)

    def finish(self, harmless: Collection[str] = ()) -> None:
        for key in self.data:
            if key not in self.read and key not in harmless:
                raise bad(self.name(key), "is not a supported field")

    def _value(self, key: str, required: bool) -> Any:
        value = self.get(key)
        if value is None and required:
            raise bad(self.name(key), "is required")
        return value


def _bounds(low: float | None, high: float | None) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"in [{low}, {high}]"


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return type(value).__name__
