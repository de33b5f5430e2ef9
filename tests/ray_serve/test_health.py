"""Replica health check: a stuck engine loop (a step that never returns) marks the replica
unhealthy; an idle or progressing one does not. No Ray cluster: the deployment's class is
used directly on an engine whose model step is replaced by a blocking stub."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("ray.serve")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def test_stuck_engine_loop_fails_the_health_check():
    from ray_app.deployments import EngineServer
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.server_args import ServerArgs

    engine = Engine(ServerArgs(dtype="float32", max_running_requests=4, context_length=128,
                               skip_warmup=True))
    release = threading.Event()

    def stuck_step(batch):
        release.wait(30)
        raise RuntimeError("stub step")

    engine.runner.launch = stuck_step
    server = object.__new__(EngineServer.func_or_class)  # the class Serve instantiates
    server.engine, server.role, server.stall_timeout_s = engine, "decode", 0.3
    try:
        server.check_health()  # idle: healthy
        time.sleep(0.5)
        server.check_health()  # idle for a while is still healthy
        engine.add_request(GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}))
        time.sleep(0.8)
        assert engine.loop_stalled_for() > 0.3
        with pytest.raises(RuntimeError, match="no progress"):
            server.check_health()
        release.set()  # the step fails, its request is aborted: the loop is idle again
        deadline = time.monotonic() + 10
        while engine.loop_stalled_for() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.check_health()
    finally:
        release.set()
        engine.shutdown()
