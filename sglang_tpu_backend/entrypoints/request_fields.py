"""Typed reads of JSON request fields, and the one error type every route answers 4xx with.

Every check raises :class:`APIError` naming the offending field (``param``), so the HTTP
layer can answer ``{"error": {"message", "type", "param", "code"}}`` instead of a 500.
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class APIError(Exception):
    """A client mistake: HTTP ``status_code`` with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status_code}}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def opt_field(body: dict, name: str, kind: str, default: Any = None, *, param: str | None = None,
              minimum: float | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` ("int", "number", "bool", "str", "dict", "list").

    Missing or null returns ``default``. ``minimum`` bounds int/number values from below.
    Raises APIError(param or name) for a wrong type or a value below ``minimum``.
    """
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    param = param or name
    checks = {
        "int": (is_int, "an integer"),
        "number": (is_number, "a number"),
        "bool": (lambda v: isinstance(v, bool), "a boolean"),
        "str": (lambda v: isinstance(v, str), "a string"),
        "dict": (lambda v: isinstance(v, dict), "an object"),
        "list": (lambda v: isinstance(v, list), "an array"),
    }
    ok, what = checks[kind]
    if not ok(value):
        raise APIError(f"'{param}' must be {what}, got {type(value).__name__}", param)
    if minimum is not None and value < minimum:
        raise APIError(f"'{param}' must be >= {minimum}, got {value}", param)
    return value
