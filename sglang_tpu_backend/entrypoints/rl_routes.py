"""HTTP routes of SGLang's RL surface: weights from tensors, pause / continue generation,
release / resume memory occupation (admin routes, ``auth.py``).

``POST /update_weights_from_tensor`` takes a portable payload instead of SGLang's (SGLang
sends torch tensors pickled per TP rank, which this server does not unpickle)::

    {"serialized_named_tensors": "<base64 of one safetensors file>" | ["<base64>", ...],
     "load_format": null | "safetensors", "flush_cache": true, "weight_version": "step-3",
     "abort_all_requests": false}

Each string is a whole safetensors file (``safetensors.numpy.save`` / ``safetensors.torch.save``
or ``encode_named_tensors``), base64 encoded; its tensor names are the checkpoint's (HF)
names; several strings are merged (a name in two is an error). The answer is SGLang's
``{"success", "message", "num_paused_requests"}``: 200, or 400 when the engine refused the
tensors (nothing changed). A payload that does not decode answers 400 naming the field. The
body limit is ``--max-request-body-bytes``: send large models in several calls (the prefix
cache flushed only on the last, ``flush_cache: false`` before) or raise the limit.

Under the Ray Serve app the calls reach every replica of every engine deployment
(``ray_app/ingress.RemoteEngine``). An engine without a call answers 501, with the reason the
engine gives in ``unsupported_calls`` (the Ray app: the weights update group calls).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sglang_tpu_backend.model_loader.checkpoint_io import (
    CheckpointError, read_safetensors_bytes, safetensors_bytes)
from sglang_tpu_backend.entrypoints.auth import admin_route
from sglang_tpu_backend.entrypoints.route_plumbing import _call, _engine, read_json, verify_api_key
from sglang_tpu_backend.entrypoints.request_fields import APIError, opt_field

router = APIRouter(dependencies=[Depends(verify_api_key)])
FIELD = "serialized_named_tensors"


def encode_named_tensors(named_tensors: dict[str, np.ndarray] | list[tuple[str, np.ndarray]]) -> str:
    """The ``serialized_named_tensors`` string of numpy arrays (bf16 / fp8 through ml_dtypes):
    one safetensors file, base64 encoded."""
    items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    return base64.b64encode(safetensors_bytes({k: np.asarray(v) for k, v in items.items()})).decode()


def decode_named_tensors(payload: Any) -> dict[str, np.ndarray]:
    """``serialized_named_tensors`` (a string or a list of them) -> ``{name: array}``;
    APIError (400) naming the field when it does not decode."""
    parts = [payload] if isinstance(payload, str) else payload
    if not isinstance(parts, list) or not parts or not all(isinstance(p, str) for p in parts):
        raise APIError(f"'{FIELD}' must be a base64 string (one safetensors file) or a "
                       "non-empty list of them", FIELD)
    out: dict[str, np.ndarray] = {}
    for i, part in enumerate(parts):
        where = FIELD if len(parts) == 1 else f"{FIELD}[{i}]"
        try:
            tensors = read_safetensors_bytes(base64.b64decode(part, validate=True))
        except (binascii.Error, ValueError) as e:
            msg = e if isinstance(e, CheckpointError) else f"not base64 ({e})"
            raise APIError(f"'{where}' is not a base64 safetensors file: {msg}", FIELD) from None
        twice = sorted(set(tensors) & set(out))
        if twice:
            raise APIError(f"'{where}' repeats tensor(s) {twice[:3]}", FIELD)
        out.update(tensors)
    return out


def _method(request: Request, name: str) -> Callable:
    """The engine's call ``name``; 501 when it has none, with the engine's reason (its
    ``unsupported_calls`` mapping, when it has one)."""
    engine = _engine(request)
    fn = getattr(engine, name, None)
    if fn is None:
        why = getattr(engine, "unsupported_calls", {}).get(name)
        raise APIError(f"{name} is not supported by this engine" + (f": {why}" if why else ""),
                       None, 501)
    return fn


@router.post("/update_weights_from_tensor")
@admin_route
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    """The payload above -> ``{"success", "message", "num_paused_requests"}`` once the new
    weights serve (200) or refused (400)."""
    body = await read_json(request)
    fn = _method(request, "update_weights_from_tensor")
    load_format = opt_field(body, "load_format", "str")
    if load_format not in (None, "safetensors"):
        raise APIError(f"load_format {load_format!r}: this server takes safetensors payloads "
                       "(null or 'safetensors'); SGLang's pickled torch tensors are not read",
                       "load_format")
    if FIELD not in body:
        raise APIError(f"'{FIELD}' is required", FIELD)
    kwargs = dict(flush_cache=opt_field(body, "flush_cache", "bool", True),
                  weight_version=opt_field(body, "weight_version", "str"),
                  abort_all_requests=opt_field(body, "abort_all_requests", "bool", False))
    named = await asyncio.to_thread(decode_named_tensors, body[FIELD])
    result = await _call(await asyncio.to_thread(fn, named, **kwargs))
    return JSONResponse(result, status_code=200 if result["success"] else 400)


@router.post("/init_weights_update_group")
@admin_route
async def init_weights_update_group(request: Request) -> JSONResponse:
    """SGLang's ``{"master_address", "master_port", "rank_offset", "world_size",
    "group_name", "backend"}`` (backend "jax_transfer": ``managers/weight_group.py``) ->
    ``{"success", "message"}`` (400 when refused)."""
    body = await read_json(request)
    fn = _method(request, "init_weights_update_group")
    args = [_required(body, "master_address", str), _required(body, "master_port", int),
            _required(body, "rank_offset", int), _required(body, "world_size", int)]
    result = await asyncio.to_thread(
        fn, *args, group_name=opt_field(body, "group_name", "str", "weight_update_group"),
        backend=opt_field(body, "backend", "str", "jax_transfer"))
    return JSONResponse(result, status_code=200 if result["success"] else 400)


@router.post("/update_weights_from_distributed")
@admin_route
async def update_weights_from_distributed(request: Request) -> JSONResponse:
    """SGLang's ``{"names", "dtypes", "shapes", "group_name", "flush_cache",
    "weight_version"}`` -> the refit's answer once the pulled weights serve (400 refused)."""
    body = await read_json(request)
    fn = _method(request, "update_weights_from_distributed")
    names, dtypes, shapes = (_required(body, k, list) for k in ("names", "dtypes", "shapes"))
    result = await _call(await asyncio.to_thread(
        fn, names, dtypes, shapes,
        group_name=opt_field(body, "group_name", "str", "weight_update_group"),
        flush_cache=opt_field(body, "flush_cache", "bool", True),
        weight_version=opt_field(body, "weight_version", "str")))
    return JSONResponse(result, status_code=200 if result["success"] else 400)


@router.post("/destroy_weights_update_group")
@admin_route
async def destroy_weights_update_group(request: Request) -> JSONResponse:
    body = await read_json(request, allow_empty=True)
    fn = _method(request, "destroy_weights_update_group")
    result = fn(opt_field(body, "group_name", "str", "weight_update_group"))
    return JSONResponse(result, status_code=200 if result["success"] else 400)


def _required(body: dict, name: str, kind: type):
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise APIError(f"'{name}' is required and must be a {kind.__name__}", name)
    return value


@router.post("/pause_generation")
@admin_route
async def pause_generation(request: Request) -> JSONResponse:
    """``{"mode": "abort" | "retract" | "in_place"}`` (default abort) -> ``{"success",
    "mode", "num_aborted", "num_retracted"}`` once no step runs."""
    body = await read_json(request, allow_empty=True)
    mode = opt_field(body, "mode", "str", "abort")
    fn = _method(request, "pause_generation")
    return JSONResponse(await _call(await asyncio.to_thread(fn, mode)))


@router.post("/continue_generation")
@admin_route
async def continue_generation(request: Request) -> JSONResponse:
    await read_json(request, allow_empty=True)
    return JSONResponse(await _call(_method(request, "continue_generation")()))


def _tags(body: dict) -> list[str] | None:
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise APIError("'tags' must be a list of strings ('kv_cache', 'weights') or null", "tags")
    return tags


@router.post("/release_memory_occupation")
@admin_route
async def release_memory_occupation(request: Request) -> JSONResponse:
    """``{"tags": ["kv_cache", "weights"] | null}`` -> ``{"success", "tags" (released),
    "freed_bytes"}``; 400 while requests are in the engine."""
    body = await read_json(request, allow_empty=True)
    fn = _method(request, "release_memory_occupation")
    return JSONResponse(await _call(await asyncio.to_thread(fn, _tags(body))))


@router.post("/resume_memory_occupation")
@admin_route
async def resume_memory_occupation(request: Request) -> JSONResponse:
    """``{"tags": [...] | null}`` -> ``{"success", "tags" (still released)}``."""
    body = await read_json(request, allow_empty=True)
    fn = _method(request, "resume_memory_occupation")
    return JSONResponse(await _call(await asyncio.to_thread(fn, _tags(body))))
