"""Warm-up's compiles side by side (``model_executor/parallel_compile.py``).

The ahead-of-time compiles must hit the very cache entries the warm-up's runs look up: after
``precompile`` the warm-up (one thread, as before) compiles no forward, sampler or multi-step
program; if a placement, a static argument or a shape disagreed it would compile them again.
"""

from __future__ import annotations

import jax
import pytest

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.model_executor import parallel_compile, warmup
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.server_args import ServerArgs

from tests.engine.conftest import ENGINE_ARGS

STEP_PROGRAMS = ("jit(forward)", "jit(_sample_packed)", "jit(multi_decode)")


@pytest.fixture(scope="module")
def runner():
    # 8 requests, 64-token steps: one DECODE and one MIXED bucket; N = 2 adds the multi-step
    # program. compilation_cache_dir "" keeps the persistent cache out of the count.
    eng = Engine(ServerArgs(**dict(ENGINE_ARGS, max_running_requests=8, num_scheduler_steps=2,
                                   compilation_cache_dir="")), start_loop=False)
    yield eng.runner
    eng.shutdown()


def test_warm_up_after_precompile_compiles_no_step_program(runner, monkeypatch):
    one_variant = runner.sampler_variants()[:1]  # fewer programs; both phases see the same
    monkeypatch.setattr(runner, "sampler_variants", lambda: one_variant)
    shapes = runner.all_shapes()
    jax.clear_caches()  # earlier tests in this process may have compiled these very programs
    counter = CompileCounter()
    n = parallel_compile.precompile(runner, shapes, threads=2)
    # 2 forwards, the multi-step program (no top logprobs) and 1 sampler (R = L = 8) per
    # top-logprob count
    assert n == len(shapes) + 1 + 2 == 5
    ahead = counter.compiled_names
    assert sum(name in STEP_PROGRAMS for name in ahead) == n, ahead
    counter = CompileCounter()
    warmup.warm_up(runner, progress=False, compile_threads=1)
    again = [name for name in counter.compiled_names if name in STEP_PROGRAMS]
    assert again == [], f"the warm-up compiled {again} again: the cache keys disagree"


def test_compile_threads():
    assert parallel_compile.compile_threads(3) == 3
    assert 1 <= parallel_compile.compile_threads(None) <= parallel_compile.MAX_AUTO_THREADS
    with pytest.raises(ValueError, match="warmup_compile_threads"):
        parallel_compile.compile_threads(0)
    with pytest.raises(ValueError, match="--warmup-compile-threads"):
        ServerArgs(warmup_compile_threads=0)
