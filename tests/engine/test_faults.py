"""Engine resilience: a fault in any phase of a step fails only that step's requests, frees
their pages, slots and planned GDN snapshots, and the engine keeps serving; a dead or stalled
scheduler loop turns /health and /health_generate to 503 (in-process HTTP over a real Engine);
a full waiting queue answers 503.

Faults come from ``Engine.fault_injector`` (called with the phase name at the start of each
phase). The model is never called on the paths that fail before it, so the extra engine built
here compiles nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
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

    eng = Engine(ServerArgs(**{**ENGINE_ARGS, "max_running_requests": 4, "watchdog_timeout": 0.5}))
    yield eng
    eng.shutdown()


class LoopKilled(BaseException):
    """Not an Exception: step() does not recover from it, the loop thread ends."""


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
            # Now kill the loop thread for real.
            eng.fault_injector = lambda phase: (_ for _ in ()).throw(LoopKilled("injected"))
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
    # The request the dying loop held ends with an abort naming the cause, not a hang.
    assert doomed.status_code == 200
    assert doomed.json()["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "internal error: scheduler loop died: LoopKilled: injected"}
    assert not eng.loop.thread.is_alive()
    for r in dead:
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert "scheduler loop" in r.json()["error"]["message"], r.text
    assert not eng.is_healthy() and eng.loop_stalled_for() == float("inf")
    s = eng.pool_stats()
    assert s["kv_pages_used"] == 0 and s["state_slots_used"] == 0 and s["num_queued"] == 0
