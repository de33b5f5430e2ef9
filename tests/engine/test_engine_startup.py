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


def test_the_backend_opens_on_a_thread_while_the_tokenizer_loads(monkeypatch):
    """The backend's open (seconds on a TPU host) overlaps the tokenizer's load: the fake
    tokenizer load waits for the open to have started; had the open come after the load (on
    the main thread, as before), the load would wait out its timeout and record False."""
    import threading

    import jax

    from sglang_tpu_backend import tokenizer as tokenizer_module
    from sglang_tpu_backend.server_args import ServerArgs

    open_started, seen = threading.Event(), {}
    devices, load_tokenizer = jax.devices, tokenizer_module.load_tokenizer

    def opening(*a, **kw):
        seen.setdefault("open_thread", threading.current_thread().name)
        open_started.set()
        return devices(*a, **kw)

    def loading(path):
        seen["open_started_before_load_ended"] = open_started.wait(timeout=5)
        return load_tokenizer(path)

    monkeypatch.setattr(jax, "devices", opening)
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", loading)
    eng = engine_module.Engine(ServerArgs(**ENGINE_ARGS), start_loop=False)
    try:
        assert seen == {"open_thread": "backend-open", "open_started_before_load_ended": True}
        assert eng.backend_open_seconds is not None and eng.backend_open_seconds >= 0
        assert eng.status.server_info()["backend_open_seconds"] == eng.backend_open_seconds
    finally:
        eng.shutdown()
