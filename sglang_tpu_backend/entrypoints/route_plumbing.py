"""What every route module shares: the app's engine, awaiting its results, the API key check
and the JSON body reader (below ``http_server.py`` and ``rl_routes.py``, which both use it)."""

from __future__ import annotations

import inspect
import json
from typing import Any

from fastapi import Request

from sglang_tpu_backend.entrypoints.auth import authorize
from sglang_tpu_backend.entrypoints.engine_protocol import EngineAPI
from sglang_tpu_backend.entrypoints.request_fields import MAX_JSON_DEPTH, APIError, json_depth

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _engine(request: Request) -> EngineAPI:
    return request.app.state.engine


async def _call(value: Any) -> Any:
    """An Engine API result, awaited when it is an awaitable (a remote engine's call)."""
    return await value if inspect.isawaitable(value) else value


def _arg(engine, name: str, default: Any = None) -> Any:
    return getattr(getattr(engine, "args", None), name, default)


async def verify_api_key(request: Request) -> None:
    """Router dependency: the key the route's access level asks for (``auth.py``)."""
    authorize(request, _engine(request).args)


async def read_json(request: Request, *, allow_empty: bool = False) -> dict:
    """The request body as a JSON object, refusing bodies over the configured size (413);
    ``allow_empty``: no body at all is ``{}``."""
    limit = _arg(_engine(request), "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"Request body of {declared} bytes exceeds the limit of {limit} bytes", "body", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"Request body exceeds the limit of {limit} bytes", "body", 413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}
        raise APIError("Request body is empty; expected a JSON object", "body")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", "body")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"Malformed JSON body: {e}", "body") from e
    except RecursionError as e:  # backstop: json_depth should have refused it
        raise APIError("JSON body nested too deeply", "body") from e
    if not isinstance(body, dict):
        raise APIError("Request body must be a JSON object", "body")
    return body
