"""All HTTP routes (SGLang native + OpenAI) on one ``APIRouter`` over an Engine.

``create_app(engine)`` mounts :data:`router` on a FastAPI app; the Ray Serve ingress reuses
the same router and :func:`install` (``app.state.engine`` is any ``EngineAPI``,
``engine_protocol.py``: the Engine, or the Ray ingress's remote engine whose methods return
awaitables). Access follows SGLang's ``--api-key`` / ``--admin-api-key`` (``auth.py``; admin
routes are marked ``@admin_route``). Every client mistake is a 4xx JSON body
``{"error": {"message", "type": "invalid_request_error", "param": <field>, "code"}}``:
malformed JSON or JSON nested deeper than ``MAX_JSON_DEPTH``, bad fields, ``n`` or a
prompt batch over the limits in ``request_fields`` , engine ``InvalidRequestError`` (400),
``output_dir`` outside the profile root (400), missing/wrong API key (401), unknown route
(404), wrong method (405), body over ``max_request_body_bytes`` (413). The server's own state answers 503 (``type``
``service_unavailable``): a full waiting queue (``--max-queued-requests``), and on
``/health`` / ``/health_generate`` a dead or stalled scheduler loop (``Engine.health_error``;
``/health_generate`` also when its one-token request does not finish within
``HEALTH_CHECK_TIMEOUT_S``, default ``--watchdog-timeout``; concurrent probes share one probe
request). A client that disconnects stops its engine generators, which aborts the requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang_tpu_backend.entrypoints import openai_protocol as oai
from sglang_tpu_backend.entrypoints.auth import Access, access_in_route, admin_route, authorize
from sglang_tpu_backend.entrypoints.engine_protocol import EngineAPI, missing_members
from sglang_tpu_backend.entrypoints.fanout import ClientDisconnected, Fanout, run_until_disconnect
from sglang_tpu_backend.entrypoints.native_protocol import (
    LogprobAccumulator, StreamState, new_rid, parse_generate)
from sglang_tpu_backend.entrypoints.request_fields import APIError, opt_field
from sglang_tpu_backend.entrypoints.rl_routes import router as rl_router
from sglang_tpu_backend.entrypoints.route_plumbing import (
    _arg, _call, _engine, read_json, verify_api_key)
from sglang_tpu_backend.managers.io_struct import (
    GenerateReqInput, InvalidRequestError, ServiceUnavailableError)
from sglang_tpu_backend.managers.profiler import confine_output_dir

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# /health_generate's bound on its one-token request (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT);
# unset: --watchdog-timeout. Meanwhile the engine's health is polled every HEALTH_POLL_S, so a
# loop that dies or stalls past the watchdog answers 503 at once, while a slow first step (a
# compile without warm-up) does not.
HEALTH_CHECK_TIMEOUT_S: float | None = (float(os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"])
                                        if os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT") else None)
HEALTH_POLL_S = 0.5


def _fanout(request: Request, reqs: list[GenerateReqInput]) -> Fanout:
    """One Fanout over ``reqs``; their rids stay in ``app.state.inflight`` until it closes."""
    engine, inflight = _engine(request), request.app.state.inflight
    accs = [LogprobAccumulator() for _ in reqs]
    rids = [r.rid for r in reqs]
    inflight.update(rids)
    return Fanout([engine.generate_request(r) for r in reqs], transform=lambda i, out: accs[i](out),
                  on_close=lambda: inflight.difference_update(rids))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_error(e: BaseException) -> dict:
    if isinstance(e, InvalidRequestError):
        return APIError(e.message, e.field).to_dict()
    return {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "param": None, "code": 500}}


async def _sse_response(request: Request, fan: Fanout, chunks) -> Response:
    """Start ``fan`` (validation errors become 4xx here), then stream ``chunks(fan, firsts)``."""
    firsts = await run_until_disconnect(request.receive, fan.first())

    async def body() -> AsyncIterator[str]:
        try:
            async for obj in chunks(firsts):
                yield _sse(obj)
        except Exception as e:  # an engine failure mid-stream: report it in-band
            log.exception("stream failed")
            yield _sse(_stream_error(e))
        finally:
            fan.close()  # also runs when Starlette cancels us on client disconnect
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


router = APIRouter(dependencies=[Depends(verify_api_key)])


# SGLang native ---------------------------------------------------------------------------
def _unavailable(message: str) -> JSONResponse:
    return _error_response(503, message, None, "service_unavailable")


async def _health_error(engine: EngineAPI) -> str | None:
    """The engine's reason not to serve, or None."""
    return await _call(engine.health_error())


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the scheduler loop is alive and progressing; else 503 with the reason."""
    err = await _health_error(_engine(request))
    return Response(status_code=200) if err is None else _unavailable(f"Unhealthy: {err}")


async def _probe(engine: EngineAPI) -> str | None:
    """One health probe: None once a one-token request finishes; else why not, as soon as the
    engine is unhealthy (before or while waiting), or when the request fails or takes longer
    than ``HEALTH_CHECK_TIMEOUT_S``."""
    if (err := await _health_error(engine)) is not None:
        return err
    limit = HEALTH_CHECK_TIMEOUT_S or _arg(engine, "watchdog_timeout", 300.0)
    deadline = time.monotonic() + limit
    task = asyncio.ensure_future(_call(engine.health_generate()))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=min(HEALTH_POLL_S, max(0.0, deadline - time.monotonic())))
            if task.done():
                break
            if (err := await _health_error(engine)) is not None:
                return err
            if time.monotonic() >= deadline:
                return f"no token generated within {limit:g} s"
        return None if task.result() else "the health request was aborted"
    except ServiceUnavailableError as e:
        return str(e)
    finally:
        if not task.done():
            task.cancel()  # its generator aborts the health request


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token request finishes, else 503 with the reason (``_probe``). One probe
    runs at a time: a call while one runs waits for that probe's answer, so any number of
    callers put at most one request into the engine."""
    state = request.app.state
    if state.health_probe is None or state.health_probe.done():
        state.health_probe = asyncio.ensure_future(_probe(_engine(request)))
    err = await asyncio.shield(state.health_probe)  # a caller leaving does not end the probe
    return Response(status_code=200) if err is None else _unavailable(f"Unhealthy: {err}")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (``sglang:*`` families); open like the health checks."""
    from sglang_tpu_backend.metrics.collector import CONTENT_TYPE

    return Response(await _call(_engine(request).metrics_text()), media_type=CONTENT_TYPE)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> dict:
    return await _call(_engine(request).get_model_info())


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict:
    engine = _engine(request)
    info = dict(await _call(engine.get_server_info()))
    info["pool_stats"] = await _call(engine.pool_stats())
    return info


@router.get("/get_load")
async def get_load(request: Request) -> list:
    """SGLang's load report: ``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]``."""
    return await _call(_engine(request).get_load())


@router.post("/start_profile")
@router.get("/start_profile")
@admin_route
async def start_profile(request: Request) -> Response:
    """Start a ``jax.profiler`` trace. Body (optional): ``output_dir`` (inside
    ``--profile-dir-root``, its default; a relative path is taken under it; anything that
    resolves outside: 400), ``num_steps`` (stop by itself after that many engine steps). 400
    when one is already running."""
    body = {} if request.method == "GET" else await read_json(request, allow_empty=True)
    engine = _engine(request)
    out = confine_output_dir(opt_field(body, "output_dir", "str"), _arg(engine, "profile_dir_root"))
    await _call(await asyncio.to_thread(  # starting and stopping a trace block: off the loop
        engine.start_profile, output_dir=out, num_steps=opt_field(body, "num_steps", "int", minimum=1)))
    return Response(content="Start profiling.\n", status_code=200)


@router.post("/stop_profile")
@router.get("/stop_profile")
@admin_route
async def stop_profile(request: Request) -> Response:
    """Stop the trace and write it under ``<output_dir>/plugins/profile/``; 400 when none runs."""
    out = await _call(await asyncio.to_thread(_engine(request).stop_profile))
    return Response(content=f"Stop profiling. The trace is in {out}.\n", status_code=200)


@router.post("/start_expert_distribution_record")
@router.get("/start_expert_distribution_record")
@admin_route
async def start_expert_distribution_record(request: Request) -> Response:
    """SGLang's expert distribution record: routed rows per expert and MoE layer, counted from
    now on (the engine records from start-up; this drops what it had). 400 when the engine
    runs without router stats."""
    await _call(_engine(request).start_expert_distribution_record())
    return Response(content="Start recording the expert distribution.\n", status_code=200)


@router.post("/stop_expert_distribution_record")
@router.get("/stop_expert_distribution_record")
@admin_route
async def stop_expert_distribution_record(request: Request) -> Response:
    await _call(_engine(request).stop_expert_distribution_record())
    return Response(content="Stop recording the expert distribution.\n", status_code=200)


@router.post("/dump_expert_distribution_record")
@router.get("/dump_expert_distribution_record")
@admin_route
async def dump_expert_distribution_record(request: Request) -> JSONResponse:
    """Write the record as a load file for ``--init-expert-location`` into ``output_dir``
    (optional; under ``--profile-dir-root`` like traces, 400 outside it) -> ``{"success",
    "path"}`` (a Ray app: every replica's file, each on its replica's node)."""
    body = {} if request.method == "GET" else await read_json(request, allow_empty=True)
    engine = _engine(request)
    out = confine_output_dir(opt_field(body, "output_dir", "str"), _arg(engine, "profile_dir_root"))
    path = await _call(await asyncio.to_thread(engine.dump_expert_distribution_record, out))
    return JSONResponse({"success": True, "path": path})


@router.post("/flush_cache")
@router.get("/flush_cache")
@admin_route
async def flush_cache(request: Request) -> JSONResponse:
    """Empty the prefix cache (at any time: pages running requests use are freed when they
    end); 500 when a remote engine reports that some replica did not flush."""
    if not await _call(_engine(request).flush_cache()):
        return _error_response(500, "Cache not flushed on every engine replica", None, "server_error")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/update_weights_from_disk")
@admin_route
async def update_weights_from_disk(request: Request) -> JSONResponse:
    """SGLang's weight update: ``{"model_path", "load_format"?, "abort_all_requests"?,
    "weight_version"?}`` -> ``{"success", "message", "num_paused_requests"}``, 200 or 400 (a
    refused checkpoint: the old weights keep serving). Runs on a worker thread; answers once
    the new weights serve (``Engine.update_weights_from_disk``)."""
    body = await read_json(request)
    engine = _engine(request)
    model_path = opt_field(body, "model_path", "str")
    if not model_path:
        raise APIError("'model_path' (a checkpoint directory) is required", "model_path")
    kwargs = dict(load_format=opt_field(body, "load_format", "str"),
                  abort_all_requests=opt_field(body, "abort_all_requests", "bool", False),
                  weight_version=opt_field(body, "weight_version", "str"))
    result = await _call(await asyncio.to_thread(engine.update_weights_from_disk, model_path, **kwargs))
    return JSONResponse(result, status_code=200 if result["success"] else 400)


@router.get("/get_weight_version")
@router.get("/weight_version")
async def get_weight_version(request: Request) -> dict:
    """``{"weight_version"}``: the label of the weights serving now (also in /get_model_info);
    the engine's ``get_weight_version`` when it has one (the Ray app: every replica's, 503
    when they differ)."""
    engine = _engine(request)
    if getattr(engine, "get_weight_version", None) is not None:
        return {"weight_version": await _call(engine.get_weight_version())}
    info = await _call(engine.get_model_info())
    return {"weight_version": info.get("weight_version", "default")}


@router.post("/abort_request")
@access_in_route
async def abort_request(request: Request) -> dict:
    """``{"rid"}`` aborts one request (NORMAL access); ``{"abort_all": true}`` every request of
    this server (ADMIN access, ``auth.py``)."""
    body = await read_json(request)
    engine = _engine(request)
    abort_all = opt_field(body, "abort_all", "bool", False)
    authorize(request, engine.args, Access.ADMIN if abort_all else Access.NORMAL)
    if abort_all:
        rids = sorted(request.app.state.inflight)
        return {"success": True, "aborted": sum([bool(await _call(engine.abort_request(r))) for r in rids])}
    rid = opt_field(body, "rid", "str")
    if rid is None:
        raise APIError("'rid' (string) is required unless 'abort_all' is true", "rid")
    return {"success": bool(await _call(engine.abort_request(rid)))}


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await read_json(request)
    parsed = parse_generate(body, request.app.state.seed_rng)
    fan = _fanout(request, parsed.reqs)
    if not parsed.stream:
        outs = await run_until_disconnect(request.receive, fan.last())
        for out, req in zip(outs, parsed.reqs):
            out.setdefault("meta_info", {}).setdefault("id", req.rid)
        return JSONResponse(outs if parsed.is_batch else outs[0])

    states = [StreamState() for _ in parsed.reqs]

    def fmt(i: int, out: dict) -> dict:
        chunk = states[i].chunk(out)
        chunk["meta_info"].setdefault("id", parsed.reqs[i].rid)
        return {**chunk, "index": i} if parsed.is_batch else chunk

    async def chunks(firsts):
        for i, out in enumerate(firsts):
            if out is not None:
                yield fmt(i, out)
        async for i, out in fan.rest():
            yield fmt(i, out)

    return await _sse_response(request, fan, chunks)


# OpenAI ----------------------------------------------------------------------------------
async def _model_name(engine) -> str:
    info = await _call(engine.get_model_info())
    return _arg(engine, "served_model_name") or info.get("served_model_name") or info.get("model_path") or "default"


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = _engine(request)
    info = await _call(engine.get_model_info())
    max_len = _arg(engine, "context_length") or info.get("context_length")
    return {"object": "list", "data": [{
        "id": await _model_name(engine), "object": "model", "created": int(time.time()), "owned_by": "sglang",
        "root": info.get("model_path"), "max_model_len": max_len}]}


async def _openai(request: Request, parse, build) -> Response:
    body = await read_json(request)
    engine = _engine(request)
    req = parse(body, await _model_name(engine), engine.tokenizer, request.app.state.seed_rng)
    rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + new_rid()
    fan = _fanout(request, req.reqs)
    try:
        if not req.stream:
            outs = await run_until_disconnect(request.receive, fan.last())
            return JSONResponse(build(req, rid, outs))
        builder = oai.ChunkBuilder(req, rid)

        async def chunks(firsts):
            for i, out in enumerate(firsts):
                if out is not None and (c := builder.chunk(i, out)) is not None:
                    yield c
            async for i, out in fan.rest():
                if (c := builder.chunk(i, out)) is not None:
                    yield c
            if (u := builder.usage_chunk()) is not None:
                yield u

        return await _sse_response(request, fan, chunks)
    except InvalidRequestError as e:
        raise APIError(e.message, oai.openai_field(e.field)) from e


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _openai(request, oai.parse_completion_request, oai.completion_response)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    engine = _engine(request)
    parse = functools.partial(oai.parse_chat_request, reasoning_parser=_arg(engine, "reasoning_parser"),
                              tool_call_parser=_arg(engine, "tool_call_parser"))
    return await _openai(request, parse, oai.chat_response)


# App -------------------------------------------------------------------------------------
def _error_response(status: int, message: str, param: str | None, err_type: str = "invalid_request_error"):
    return JSONResponse(APIError(message, param, status, err_type).to_dict(), status_code=status)


def install(app: FastAPI, engine) -> None:
    """Attach ``engine``, the routes and the JSON error handlers to ``app``.

    Raises TypeError naming what ``engine`` lacks of ``EngineAPI``."""
    missing = missing_members(engine)
    if missing:
        raise TypeError(f"{type(engine).__name__} does not provide the EngineAPI "
                        f"(engine_protocol.py): missing {', '.join(missing)}")
    app.state.engine = engine
    app.state.health_probe = None  # the /health_generate probe in progress (an asyncio task)
    app.state.seed_rng = random.Random(_arg(engine, "random_seed", 0))
    app.state.inflight = set()  # rids of requests being served, for abort_all
    app.include_router(router)
    app.include_router(rl_router)  # SGLang's RL surface (rl_routes.py)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.to_dict(), status_code=e.status_code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return _error_response(400, e.message, e.field)

    @app.exception_handler(ServiceUnavailableError)
    async def _unavailable_error(request: Request, e: ServiceUnavailableError):
        return _unavailable(str(e))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return _error_response(404, f"Route {request.method} {request.url.path} not found", "path")
        if e.status_code == 405:
            return _error_response(405, f"Method {request.method} not allowed for {request.url.path}", "method")
        return _error_response(e.status_code, str(e.detail), None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error_response(500, f"Internal server error: {type(e).__name__}: {e}", None, "server_error")


def create_app(engine) -> FastAPI:
    """A FastAPI app serving ``engine`` (an Engine or anything with its API)."""
    app = FastAPI(title="sglang-tpu-backend", docs_url=None, redoc_url=None, openapi_url=None)
    install(app, engine)
    return app
