"""Warm-up's compiles side by side (``model_executor/parallel_compile.py``).

The ahead-of-time compiles must hit the very cache entries the warm-up's runs look up: after
``precompile`` the warm-up (one thread, as before) compiles no forward, sampler or multi-step
program; if a placement, a static argument or a shape disagreed it would compile them again.
With multi-step decoding the warm-up compiles one N-step program per DECODE bucket, its
sampler variants branches of it (``multistep.py``), and serving any mix compiles nothing.
"""

from __future__ import annotations

import jax
import pytest

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.model_executor import parallel_compile, warmup
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.server_args import ServerArgs

from tests.engine.conftest import ENGINE_ARGS, serving

STEP_PROGRAMS = ("jit(forward)", "jit(_sample_packed)", "jit(multi_decode)", "jit(copy_rows)")


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
    # 2 forwards, the multi-step program (no top logprobs), 1 sampler (R = L = 8) per
    # top-logprob count and the snapshot copies (into the slots and out, per copy bucket)
    copies = 2 * len(runner.snapshots.buckets)
    assert n == len(shapes) + 1 + 2 + copies == 5 + copies
    ahead = counter.compiled_names
    assert sum(name in STEP_PROGRAMS[:3] for name in ahead) == n - copies, ahead
    # (the two directions are one program where snapshots and slots are as many)
    assert len(runner.snapshots.buckets) <= ahead.count("jit(copy_rows)") <= copies, ahead
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


MS_STEPS = 8


@pytest.fixture(scope="module")
def warm_ms():
    """An N = 8 engine (the default 3 DECODE buckets: 8, 32, 64 requests) warmed up on two
    compile threads (``precompile``, then the loop); yields it and the names of the programs
    its warm-up compiled."""
    for eng in serving(dict(ENGINE_ARGS, num_scheduler_steps=MS_STEPS, compilation_cache_dir="")):
        jax.clear_caches()  # earlier tests in this process may have compiled these very programs
        counter = CompileCounter()
        eng.runner.warmup(progress=False, compile_threads=2)
        yield eng, counter.compiled_names


def test_warm_up_compiles_one_multistep_program_per_decode_bucket(warm_ms):
    """One N-step program per DECODE bucket, not one per bucket and sampler variant."""
    eng, names = warm_ms
    shapes = eng.runner.all_shapes()
    decode = [s for s in shapes if s[0] == ForwardMode.DECODE]
    assert len(decode) == 3
    assert names.count("jit(multi_decode)") == len(decode), names
    # precompile's tasks: the forwards, one multi-step program per DECODE bucket, and the
    # samplers (3 variants x 2 top-logprob counts per (R, L))
    samplers = 3 * 2 * len({(R, L) for _, _, R, L in shapes})
    assert len(parallel_compile.tasks(eng.runner, shapes)) == len(shapes) + len(decode) + samplers


def test_multistep_mix_equals_single_steps_and_compiles_nothing(warm_ms, clean_engine):
    """Greedy, temperature and top_p < 1 requests (and one with top_k, a penalty and a logit
    bias) in one batch at N = 8: the tokens (and logprobs) of N = 1, every sampler branch run
    by a multi-step launch (FULL's while the top_p and bias requests run, then PLAIN's, then
    GREEDY's), and no program lowered."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.model_executor.sampler_state import sampler_variant
    from sglang_tpu_backend.sampling import sampler
    from tests.engine.conftest import wait_pools_empty
    from tests.engine.test_overlap import _run, _same

    def objs():
        sps = [{"temperature": 0.9, "top_p": 0.8, "max_new_tokens": 9},
               {"temperature": 0.7, "max_new_tokens": 30},
               {"temperature": 0, "max_new_tokens": 55},
               {"temperature": 0.8, "top_k": 5, "frequency_penalty": 0.3, "max_new_tokens": 12,
                "logit_bias": {"17": 4.0, "40": -100.0}}]
        return [GenerateReqInput(input_ids=[7 + i, 30 + 5 * i, 11, 2 + i], return_logprob=True,
                                 sampling_params=dict(sp, seed=i, ignore_eos=True))
                for i, sp in enumerate(sps)]

    want = _run(clean_engine, objs())
    eng, _ = warm_ms
    runner, branches = eng.runner, set()
    real = runner.launch

    def launch(batch):
        if batch.num_steps > 1:
            branches.add(sampler.multistep_branch(sampler_variant(batch.chunks)))
        return real(batch)

    counter = CompileCounter()
    runner.launch = launch
    try:
        got = _run(eng, objs())
    finally:
        runner.launch = real
    for g, w in zip(got, want):
        _same(g, w)
    assert branches == {0, 1, 2}, branches
    assert counter.lowerings == 0, f"{counter.lowerings} programs lowered after warm-up"
    assert wait_pools_empty(eng)["kv_pages_used"] == 0
