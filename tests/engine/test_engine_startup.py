"""An engine's start-up report: seconds by phase, and the persistent compilation cache opened
before the weights load (so the loader's programs are cached as well)."""

from __future__ import annotations

import time

from sglang_tpu_backend import engine as engine_module
from sglang_tpu_backend.model_executor import compile_cache
from tests.engine.conftest import ENGINE_ARGS


def test_startup_seconds_by_phase_and_the_cache_opens_before_the_load(monkeypatch):
    from sglang_tpu_backend.server_args import ServerArgs

    order = []
    enable, make_runner = compile_cache.enable_persistent_cache, engine_module._make_runner
    monkeypatch.setattr(compile_cache, "enable_persistent_cache",
                        lambda d: order.append("cache") or enable(d))
    monkeypatch.setattr(engine_module, "_make_runner",
                        lambda *a: order.append("runner") or make_runner(*a))
    t0 = time.perf_counter()
    eng = engine_module.Engine(ServerArgs(**ENGINE_ARGS), start_loop=False)
    total = time.perf_counter() - t0
    try:
        assert order == ["cache", "runner"]
        phases = eng.startup_seconds
        assert list(phases) == ["tokenizer_and_config", "devices", "other", "runner", "warmup"]
        assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total
        assert eng.status.server_info()["startup_seconds"] == phases
    finally:
        eng.shutdown()
