"""Typed reads of JSON request fields, and the one error type every route answers 4xx with.

Every check raises :class:`APIError` naming the offending field (``param``), so the HTTP
layer can answer ``{"error": {"message", "type", "param", "code"}}`` instead of a 500.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_MISSING = object()

# Request-size limits (constants, not flags). A body fans out into one engine request per
# prompt and sample, all queued at once (FIFO), so these bound what one client can put ahead
# of everyone else: n as OpenAI caps it (128), and prompts x n per body.
MAX_N = 128
MAX_REQUESTS_PER_BODY = 1024
MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


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


def check_fanout(num_prompts: int, n: int, prompt_param: str, n_param: str) -> None:
    """Refuse a body that would fan out into more than ``MAX_REQUESTS_PER_BODY`` engine
    requests, or asks for more than ``MAX_N`` samples (APIError naming the field)."""
    if num_prompts > MAX_REQUESTS_PER_BODY:
        raise APIError(f"'{prompt_param}' holds {num_prompts} prompts; at most "
                       f"{MAX_REQUESTS_PER_BODY} per request", prompt_param)
    if n > MAX_N:
        raise APIError(f"'{n_param}' must be <= {MAX_N}, got {n}", n_param)
    if num_prompts * n > MAX_REQUESTS_PER_BODY:
        raise APIError(f"{num_prompts} prompts x '{n_param}' {n} = {num_prompts * n} samples; at "
                       f"most {MAX_REQUESTS_PER_BODY} per request", n_param)


def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays/objects in the JSON text ``raw`` (brackets inside strings
    do not count). Cheap: a count when there are few brackets, else one regex pass to drop
    strings and a numpy running sum."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return raw.count(b"[") + raw.count(b"{")  # an upper bound, below the limit
    a = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = (np.isin(a, (ord("["), ord("{"))).astype(np.int64)
            - np.isin(a, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(step).max(initial=0))
