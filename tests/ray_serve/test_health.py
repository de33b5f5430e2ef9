"""Replica and application health without a Ray cluster: the deployment's class is used
directly on an engine whose model step is replaced, first by a blocking stub (a stuck loop),
then by one raising a BaseException (a dead loop); the ingress's ``RemoteEngine`` reads the
replicas through :class:`FakeDeployment`, a deployment handle over in-process replicas.

A stuck or dead engine loop marks the replica unhealthy (Serve's ``check_health`` raises) and
turns the application's ``/health`` into 503 naming the deployment; an idle or progressing one
does not; a deployment with no running replica is unhealthy too."""

from __future__ import annotations

import inspect
import os
import threading
import time

import pytest

serve = pytest.importorskip("ray.serve")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _Response:
    """A handle call's answer: awaitable, or async-iterable for a streaming method; cancellable
    (the next output then raises Serve's RequestCancelledError, as a cancelled call does)."""

    def __init__(self, value):
        self.value, self.cancelled = value, False

    def __await__(self):
        value = self.value
        return (value if inspect.isawaitable(value) else _resolved(value)).__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            raise serve.exceptions.RequestCancelledError("cancelled")
        return await self.value.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


async def _resolved(value):
    return value


class FakeDeployment:
    """A ``DeploymentHandle`` over in-process replicas (``EngineServer`` objects): a call
    (``handle.method.remote(...)``) reaches the first replica, as Serve's router may route it;
    ``broadcast`` reaches every replica (none: Serve's DeploymentUnavailableError)."""

    app_name = "app"

    def __init__(self, name: str, replicas: list):
        self.deployment_name, self.replicas = name, replicas

    def options(self, **_):
        return self

    def __getattr__(self, method: str):
        replica = self.replicas[0]
        return type("Method", (), {"remote": staticmethod(
            lambda *a, **k: _Response(getattr(replica, method)(*a, **k)))})

    def broadcast(self, method: str, *args, **kwargs):
        from ray.serve._private.common import DeploymentID

        replicas, name = self.replicas, self.deployment_name

        class Answers:
            async def results_async(self, timeout_s=None, return_exceptions=False):
                if not replicas:
                    raise serve.exceptions.DeploymentUnavailableError(DeploymentID(name, "app"))
                return [getattr(r, method)(*args, **kwargs) for r in replicas]

        return Answers()


def replica(engine, replica_id: str, role: str = "colocated", stall_timeout_s: float = 600.0):
    """An ``EngineServer`` over ``engine``, built without Serve (the class Serve instantiates)."""
    from ray_app.deployments import EngineServer

    server = object.__new__(EngineServer.func_or_class)
    server.engine, server.role, server.replica_id = engine, role, replica_id
    server.stall_timeout_s = stall_timeout_s
    return server


class LoopKiller(BaseException):
    """What the engine's phases do not recover from: it ends the scheduler loop thread."""


def test_stuck_or_dead_engine_loop_fails_the_replica_and_the_app_health():
    from fastapi.testclient import TestClient

    from ray_app.ingress import RemoteEngine
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.server_args import ServerArgs

    args = ServerArgs(dtype="float32", max_running_requests=4, context_length=128, skip_warmup=True)
    engine = Engine(args)
    release = threading.Event()

    def stuck_step(batch):
        release.wait(30)
        raise RuntimeError("stub step")

    def dying_step(batch):
        raise LoopKiller("stub fault")

    engine.runner.launch = stuck_step
    server = replica(engine, "r-decode", role="decode", stall_timeout_s=0.3)
    pd = RemoteEngine(args, decode=FakeDeployment("DecodeServer", [server]),
                      prefill=FakeDeployment("PrefillServer", [replica(engine, "r-prefill", "prefill")]))
    client = TestClient(create_app(pd))

    def app_health() -> tuple[int, str]:
        r = client.get("/health")
        return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""

    try:
        server.check_health()  # idle: healthy
        time.sleep(0.5)
        server.check_health()  # idle for a while is still healthy
        assert app_health() == (200, "")
        engine.add_request(GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}))
        time.sleep(0.8)
        assert engine.loop_stalled_for() > 0.3
        with pytest.raises(RuntimeError, match="no progress"):
            server.check_health()
        code, message = app_health()
        assert code == 503
        assert "DecodeServer replica r-decode: decode engine loop made no progress" in message
        release.set()  # the step fails, its request is aborted: the loop is idle again
        deadline = time.monotonic() + 10
        while engine.loop_stalled_for() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.check_health()
        assert app_health() == (200, "")

        engine.runner.launch = dying_step
        engine.add_request(GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}))
        deadline = time.monotonic() + 10
        while engine.health_error() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="scheduler loop died"):
            server.check_health()
        code, message = app_health()
        assert code == 503
        assert "DecodeServer replica r-decode: decode engine: the scheduler loop died" in message
        assert "PrefillServer replica r-prefill: prefill engine: the scheduler loop died" in message

        none_running = RemoteEngine(args, engine=FakeDeployment("EngineServer", []))
        r = TestClient(create_app(none_running)).get("/health")
        assert r.status_code == 503
        assert "EngineServer: no running replica" in r.json()["error"]["message"]
    finally:
        release.set()
        engine.shutdown()
