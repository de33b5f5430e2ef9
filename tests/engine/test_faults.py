"""Engine resilience: a fault in any phase of a step fails only that step's requests, frees
their pages, slots and planned GDN snapshots, and the engine keeps serving; so does a fault in
the loop's work between steps (profiler, handover export / install, weight swap). Repeated
step faults, a dead, stalled or (multi-host) fatally failed scheduler loop turn /health and
/health_generate to 503 (in-process HTTP over a real Engine); a full waiting queue answers 503.

Faults come from ``Engine.fault_injector`` (called with the phase name at the start of each
phase). The model is never called on the paths that fail before it, so the extra engine built
here compiles nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time

import httpx
import pytest

from sglang_tpu_backend.engine import PHASES
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from tests.engine.conftest import ENGINE_ARGS, wait_pools_empty


def prompt(seed: int, n: int = 40) -> list[int]:
    """Distinct prompts per test (no prefix-cache hits); 40 tokens plan GDN snapshots."""
    return [3 + (seed * 37 + i * 11) % 900 for i in range(n)]


def req(seed: int, rid: str, max_new: int = 4) -> GenerateReqInput:
    return GenerateReqInput(input_ids=prompt(seed), rid=rid,
                            sampling_params={"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})


async def finals(engine, objs):
    async def one(o):
        return [x async for x in engine.generate_request(o)][-1]
    return await asyncio.gather(*(one(o) for o in objs))


class FaultOnce:
    """Raises RuntimeError once at the start of ``phase``, recording the rids that step holds."""

    def __init__(self, engine, phase: str):
        self.engine, self.phase, self.fired, self.rids = engine, phase, False, None
        self.batch = self.completing = None
        schedule = engine.scheduler.schedule

        def recording_schedule():  # remembers the step's batch (the model phase has no lock)
            self.batch = schedule()
            return self.batch

        complete = engine.runner.complete

        def recording_complete(launched):  # with overlap, the step completing is an older one
            self.completing = launched.batch
            return complete(launched)

        def restore():
            engine.scheduler.schedule = schedule
            engine.runner.complete = complete

        self.restore = restore
        engine.scheduler.schedule = recording_schedule
        engine.runner.complete = recording_complete

    def __call__(self, phase: str) -> None:
        if phase != self.phase or self.fired:
            return
        self.fired = True
        if phase == "schedule":  # schedule() fails every request the scheduler holds
            self.rids = {r.rid for r in self.engine.scheduler.all_requests()}
        elif phase == "model":  # launching the step just scheduled
            self.rids = {c.req.rid for c in self.batch.chunks}
        else:  # processing / delivering the step being completed
            self.rids = {c.req.rid for c in self.completing.chunks}
        raise RuntimeError(f"injected {phase} fault")


@pytest.mark.parametrize("phase", PHASES)
def test_fault_in_each_phase_fails_only_that_step(clean_engine, phase):
    eng = clean_engine
    k = PHASES.index(phase)
    errors_before = eng.stats["num_errors"]
    fault = FaultOnce(eng, phase)
    eng.fault_injector = fault
    try:
        objs = [req(10 * k + i, f"fault-{phase}-{i}") for i in range(3)]
        outs = asyncio.run(finals(eng, objs))
    finally:
        eng.fault_injector = None
        fault.restore()
    assert fault.fired and fault.rids
    for o in outs:
        fr = o["meta_info"]["finish_reason"]
        if o["meta_info"]["id"] in fault.rids:
            assert fr == {"type": "abort", "message": f"internal error: RuntimeError: injected {phase} fault"}
        else:  # requests outside the failing step finish normally
            assert fr["type"] == "length" and len(o["output_ids"]) == 4, o
    assert eng.stats["num_errors"] == errors_before + 1
    stats = wait_pools_empty(eng)
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0, stats
    eng.flush_cache()  # nothing leaked into the prefix cache: its snapshots all come back
    assert eng.pool_stats()["gdn_snapshots_used"] == 0
    # Later requests succeed (one with a failed request's prompt).
    again = asyncio.run(finals(eng, [req(10 * k, f"after-{phase}")]))[0]
    assert again["meta_info"]["finish_reason"]["type"] == "length" and len(again["output_ids"]) == 4


def step_errors(engine, phase: str) -> float:
    """``sglang:num_step_errors_total`` of ``phase`` in the engine's exposition (0 if absent)."""
    m = re.search(r'sglang:num_step_errors_total\{[^}]*phase="%s"[^}]*\} (\S+)' % phase,
                  engine.metrics_text().decode())
    return float(m.group(1)) if m else 0.0


class RaiseOnce:
    """Wraps ``fn``: the first call raises RuntimeError(message), later calls are ``fn``'s."""

    def __init__(self, fn, message: str):
        self.fn, self.message, self.fired = fn, message, False

    def __call__(self, *a, **kw):
        if not self.fired:
            self.fired = True
            raise RuntimeError(self.message)
        return self.fn(*a, **kw)


def assert_serving(engine, errors_before: int, phase: str, seed: int) -> None:
    """One fault was counted, nothing leaked, the loop lives and serves a new request."""
    assert engine.stats["num_errors"] == errors_before + 1
    assert step_errors(engine, phase) >= 1
    assert engine.loop.thread.is_alive() and engine.health_error() is None
    stats = wait_pools_empty(engine)
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0, stats
    again = asyncio.run(finals(engine, [req(seed, f"after-{phase}")]))[0]
    assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_profiler_fault_keeps_the_loop(clean_engine, monkeypatch):
    eng = clean_engine
    errors_before = eng.stats["num_errors"]
    on_step = RaiseOnce(eng.loop.profiler.on_step, "profiler broke")
    monkeypatch.setattr(eng.loop.profiler, "on_step", on_step)
    outs = asyncio.run(finals(eng, [req(60, "prof-0"), req(61, "prof-1")]))
    assert on_step.fired
    for o in outs:  # the step itself had succeeded: its requests are unaffected
        assert o["meta_info"]["finish_reason"]["type"] == "length", o
    assert_serving(eng, errors_before, "profiler", 62)


def test_handover_export_and_install_faults_keep_the_loop(clean_engine, monkeypatch):
    eng = clean_engine
    # Prefill side: the locked part of the export fails; the request ends with the error.
    errors_before = eng.stats["num_errors"]
    release = RaiseOnce(eng.scheduler.release_exported, "export broke")
    monkeypatch.setattr(eng.scheduler, "release_exported", release)
    out, h = asyncio.run(eng.prefill_for_handover(req(63, "export-fault", max_new=8)))
    assert release.fired and h is None
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "internal error: RuntimeError: export broke"}
    assert_serving(eng, errors_before, "export", 64)
    # Decode side: admitting a handed-over request fails; it ends with the error.
    _, h = asyncio.run(eng.prefill_for_handover(req(65, "install-fault", max_new=8)))
    assert h is not None
    errors_before = eng.stats["num_errors"]
    admit = RaiseOnce(eng.scheduler.admit_installed, "install broke")
    monkeypatch.setattr(eng.scheduler, "admit_installed", admit)

    async def decode():
        return [o async for o in eng.generate_from_handover(h)][-1]

    out = asyncio.run(decode())
    assert admit.fired
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "internal error: RuntimeError: install broke"}
    assert_serving(eng, errors_before, "install", 66)
    out = asyncio.run(decode())  # the same handover installs fine now
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 8


def test_weight_swap_fault_keeps_the_loop(clean_engine, monkeypatch):
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    eng = clean_engine
    errors_before, version = eng.stats["num_errors"], eng.weight_version
    flush = RaiseOnce(eng.scheduler.prefix.flush, "flush broke")
    monkeypatch.setattr(eng.scheduler.prefix, "flush", flush)
    res = eng.update_weights_from_disk(str(default_model_path()))
    assert flush.fired
    assert not res["success"] and "flush broke" in res["message"], res
    assert eng.weight_version == version and eng.weights.pending is None
    assert_serving(eng, errors_before, "swap", 67)


def test_queue_full_is_503_over_http(clean_engine):
    from sglang_tpu_backend.entrypoints.http_server import create_app

    eng = clean_engine
    args = eng.args
    eng.args = dataclasses.replace(args, max_queued_requests=1)
    release = threading.Event()

    def hold_model(phase):  # keep the first step in the model call: nothing leaves the queue
        if phase == "model":
            release.wait(30)

    async def go():
        app = create_app(eng)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = asyncio.ensure_future(c.post("/generate", json={
                "input_ids": prompt(90), "sampling_params": {"max_new_tokens": 2}}))
            while eng.pool_stats()["num_running"] == 0:  # admitted, its step held
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(c.post("/generate", json={
                "input_ids": prompt(91), "sampling_params": {"max_new_tokens": 2}}))
            while eng.pool_stats()["num_queued"] == 0:
                await asyncio.sleep(0.01)
            full = await c.post("/v1/completions", json={"prompt": prompt(92), "max_tokens": 2})
            release.set()
            return full, await first, await second

    eng.fault_injector = hold_model
    try:
        full, first, second = asyncio.run(go())
    finally:
        release.set()
        eng.fault_injector = None
        eng.args = args
    assert full.status_code == 503, full.text
    err = full.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503
    assert "queue is full" in err["message"] and "--max-queued-requests" in err["message"]
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)


@pytest.fixture(scope="module")
def lone_engine():
    """An engine of its own: these tests stall it and then kill its loop for good."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**{**ENGINE_ARGS, "max_running_requests": 4, "watchdog_timeout": 0.5,
                               "max_consecutive_step_errors": 2}))
    yield eng
    eng.shutdown()


def test_consecutive_step_faults_turn_health_to_503(lone_engine):
    """Each failing step fails only its requests, but steps failing in a row mean a broken
    replica: /health answers 503 from --max-consecutive-step-errors on, until a step succeeds."""
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app

    eng = lone_engine
    client = TestClient(create_app(eng))

    def fail_model(phase):
        if phase == "model":
            raise RuntimeError("device lost")

    eng.fault_injector = fail_model
    try:
        first = asyncio.run(finals(eng, [req(70, "broken-0")]))[0]
        after_one = client.get("/health")
        second = asyncio.run(finals(eng, [req(71, "broken-1")]))[0]
        after_two = client.get("/health")
    finally:
        eng.fault_injector = None
    for o in (first, second):
        assert o["meta_info"]["finish_reason"]["message"] == "internal error: RuntimeError: device lost"
    assert after_one.status_code == 200, after_one.text
    assert after_two.status_code == 503, after_two.text
    msg = after_two.json()["error"]["message"]
    assert "--max-consecutive-step-errors 2" in msg and "device lost" in msg, msg
    assert step_errors(eng, "model") == 2
    ok = asyncio.run(finals(eng, [req(72, "healthy-again")]))[0]
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    assert client.get("/health").status_code == 200


def test_stalled_then_dead_loop_turns_health_to_503(lone_engine, monkeypatch):
    from sglang_tpu_backend.entrypoints import http_server

    eng = lone_engine
    monkeypatch.setattr(http_server, "HEALTH_CHECK_TIMEOUT_S", 0.2)
    release = threading.Event()

    def stall(phase):
        if phase == "model":
            release.wait(30)
            raise RuntimeError("stalled step gave up")

    async def go():
        app = http_server.create_app(eng)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            eng.fault_injector = stall
            stuck = asyncio.ensure_future(c.post("/generate", json={"input_ids": [5, 6, 7]}))
            while eng.pool_stats()["num_running"] == 0:
                await asyncio.sleep(0.01)
            # Within the watchdog: /health is fine, /health_generate gives up after its bound.
            t0 = time.monotonic()
            r = await c.get("/health_generate")
            assert r.status_code == 503 and "no token generated" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.6)  # past --watchdog-timeout 0.5
            stalled = [await c.get("/health"), await c.get("/health_generate")]
            release.set()
            out = (await stuck).json()
            while not eng.is_healthy():
                await asyncio.sleep(0.01)
            recovered = (await c.get("/health")).status_code
            # Now a model fault on a multi-host replica: fatal, the loop thread ends.
            eng.loop.fatal_step_faults = True
            eng.fault_injector = lambda phase: (_ for _ in ()).throw(RuntimeError("collective failed"))
            doomed = await c.post("/generate", json={"input_ids": [8, 9]})
            eng.loop.thread.join(10)
            dead = [await c.get("/health"), await c.get("/health_generate"),
                    await c.post("/generate", json={"input_ids": [8, 9]})]
            return stalled, out, recovered, doomed, dead

    stalled, out, recovered, doomed, dead = asyncio.run(go())
    for r in stalled:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "no progress" in r.json()["error"]["message"] and "--watchdog-timeout" in r.json()["error"]["message"]
    assert out["meta_info"]["finish_reason"]["message"] == "internal error: RuntimeError: stalled step gave up"
    assert recovered == 200
    # The request of the fatal step ends with an abort naming the cause, not a hang.
    assert doomed.status_code == 200
    assert doomed.json()["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "internal error: RuntimeError: collective failed"}
    assert "multi-host replica" in eng.health_error() and "restart" in eng.health_error()
    assert not eng.loop.thread.is_alive()
    for r in dead:
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert "scheduler loop" in r.json()["error"]["message"], r.text
    assert not eng.is_healthy() and eng.loop_stalled_for() == float("inf")
    s = eng.pool_stats()
    assert s["kv_pages_used"] == 0 and s["state_slots_used"] == 0 and s["num_queued"] == 0
