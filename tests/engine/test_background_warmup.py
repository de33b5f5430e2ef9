"""Staged warm-up (``model_executor/background_warmup.py``): ready after one prefill bucket,
the rest compiled while serving.

While the second stage runs, every step takes the first stage's shape (a decode step as that
MIXED step, prompts chunked to its tokens, single decode steps) and serves the tokens a fully
warmed engine serves. Once it ends, decode steps take their own buckets and multi-step
launches, and nothing compiles: the programs lowered off the serving thread on abstract
arguments have the serving calls' cache keys.
"""

from __future__ import annotations

import threading

import jax
import pytest

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor import background_warmup
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_executor.step_buckets import StepBuckets

from tests.engine.conftest import ENGINE_ARGS, serving, wait_pools_empty
from tests.engine.test_overlap import _run, _same

# 8 requests, 256-token steps: token buckets 64 and 256, one DECODE bucket (8), N = 4
STAGED = dict(ENGINE_ARGS, max_running_requests=8, chunked_prefill_size=256,
              num_scheduler_steps=4, skip_warmup=False, warmup_in_background=True,
              warmup_compile_threads=1, compilation_cache_dir="")


def test_buckets_while_staged():
    b = StepBuckets(8, 256)
    assert b.first_shapes() == [(ForwardMode.MIXED, 64, 8, 8)]
    b.ready = frozenset(b.first_shapes())
    assert b.shape_for(ForwardMode.DECODE, 5, 5, 5) == (ForwardMode.MIXED, 64, 8, 8)
    assert b.shape_for(ForwardMode.MIXED, 64, 3, 3) == (ForwardMode.MIXED, 64, 8, 8)
    with pytest.raises(ValueError, match="exceeds the largest bucket 64"):
        b.shape_for(ForwardMode.MIXED, 65, 3, 3)  # the scheduler's budget keeps steps <= 64
    b.ready = None
    assert b.shape_for(ForwardMode.DECODE, 5, 5, 5) == (ForwardMode.DECODE, 8, 8, 8)
    assert b.shape_for(ForwardMode.MIXED, 65, 3, 3) == (ForwardMode.MIXED, 256, 8, 8)
    # more running requests than the smallest token bucket: the first stage takes the next
    assert StepBuckets(128, 1024).first_shapes() == [(ForwardMode.MIXED, 256, 128, 128)]


def _objs(seed: int):
    """A 90-token prompt (2 chunks of at most 64 while staged) and three short ones, their
    ids from ``seed`` (a new seed: no prefix-cache hit)."""
    prompts = [[(5 * i + seed) % 1000 + 1 for i in range(90)]] + [
        [7 + i + seed, 30 + i, 11] for i in range(3)]
    return [GenerateReqInput(input_ids=p, return_logprob=True,
                             sampling_params={"temperature": 0, "max_new_tokens": 24,
                                              "ignore_eos": True}) for p in prompts]


def test_serves_while_staged_then_at_full_speed_compiling_nothing(clean_engine, monkeypatch):
    want = [_run(clean_engine, _objs(seed)) for seed in (3, 4)]
    gate, compile_ = threading.Event(), background_warmup.BackgroundWarmup._compile

    def gated(self, lowered):  # hold the second stage until the staged steps are served
        gate.wait(timeout=600)
        return compile_(self, lowered)

    monkeypatch.setattr(background_warmup.BackgroundWarmup, "_compile", gated)
    jax.clear_caches()  # earlier tests in this process may have compiled these very programs
    for eng in serving(STAGED):
        try:
            bg, runner = eng.background_warmup, eng.runner
            assert bg is not None and not bg.done
            assert eng.get_server_info()["background_warmup"]["stage"] == "background"
            steps, launch = [], runner.launch

            def recorded(batch):
                kind = batch.kind
                shape = runner.shapes_for(kind, sum(c.num_tokens for c in batch.chunks),
                                          len(batch.chunks), len(batch.chunks))
                steps.append((kind, shape, batch.num_steps))
                return launch(batch)

            runner.launch = recorded
            for g, w in zip(_run(eng, _objs(3)), want[0]):
                _same(g, w)
            assert {shape for _, shape, _ in steps} == {(ForwardMode.MIXED, 64, 8, 8)}, steps
            assert {n for _, _, n in steps} == {1}
            assert any(kind == ForwardMode.DECODE for kind, _, _ in steps)  # ran as MIXED
            gate.set()
            assert bg.wait(timeout=600), bg.status()
            status = eng.get_server_info()["background_warmup"]
            assert status["stage"] == "complete" and status["error"] is None
            # DECODE-8 and MIXED-256 forwards, DECODE-8's multi-step program (the R = L = 8
            # samplers: stage 1), and the programs placing those two shapes' batches
            assert status["step_programs_compiled"] == status["step_programs_total"] == 3
            assert status["batch_placing_programs"] == 2
            steps.clear()
            counter = CompileCounter()
            for g, w in zip(_run(eng, _objs(4)), want[1]):
                _same(g, w)
            assert counter.lowerings == 0, f"{counter.lowered_names} lowered after stage 2"
            assert (ForwardMode.DECODE, (ForwardMode.DECODE, 8, 8, 8), 4) in steps, steps
            assert (ForwardMode.MIXED, 256, 8, 8) in {shape for _, shape, _ in steps}
            assert wait_pools_empty(eng)["kv_pages_used"] == 0
        finally:
            gate.set()
            eng.runner.launch = launch


def test_shutdown_during_the_second_stage_leaves_no_thread(monkeypatch):
    gate, compile_ = threading.Event(), background_warmup.BackgroundWarmup._compile

    def gated(self, lowered):
        gate.wait(timeout=600)
        return compile_(self, lowered)

    monkeypatch.setattr(background_warmup.BackgroundWarmup, "_compile", gated)
    before = set(threading.enumerate())
    gen = serving(dict(STAGED, num_scheduler_steps=1))
    eng = next(gen)
    assert not eng.background_warmup.done
    threading.Timer(1.0, gate.set).start()  # the compile in flight is let through
    next(gen, None)  # shutdown: stops the second stage, then the loop
    assert not eng.background_warmup.done
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()
            and t.name.startswith("warmup-background")]
    assert left == []


def test_the_first_stage_compiles_while_the_weights_load(monkeypatch):
    """The first stage's programs are lowered on the params' placed shapes and compile while
    the weights load: the load below waits (up to 120 s) for the first stage's forward to
    be compiled, which before this change happened only after the load (the wait would
    time out and record False); and the forward has been lowered when the load begins (its
    lowering no longer takes turns on the GIL with the loader's). The loaded params then hit those programs: the forward is
    compiled once before ready, not again for the real arrays, whose placements equal the
    placed shapes it was lowered on.

    A placed shape that differs from its loaded param is named by ``placed_otherwise``.
    """
    import time

    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.model_executor.backends import SingleDeviceBackend
    from sglang_tpu_backend.server_args import ServerArgs

    jax.clear_caches()  # earlier tests in this process may have compiled these very programs
    counter, seen, load = CompileCounter(), {}, SingleDeviceBackend.load_params

    def waiting_load(self, source):
        # the forward is lowered before the load starts (not beside it, on the GIL)
        seen["forward_lowered_when_the_load_began"] = "jit(forward)" in counter.lowered_names
        deadline = time.monotonic() + 120
        while "jit(forward)" not in counter.compiled_names and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["forward_compiled_before_the_load"] = "jit(forward)" in counter.compiled_names
        return load(self, source)

    monkeypatch.setattr(SingleDeviceBackend, "load_params", waiting_load)
    placed, placed_otherwise = [], background_warmup.FirstStage.placed_otherwise
    monkeypatch.setattr(background_warmup.FirstStage, "placed_otherwise", lambda self, params:
                        placed.append(placed_otherwise(self, params)) or placed[-1])
    eng = Engine(ServerArgs(**STAGED), start_loop=False)
    try:
        assert seen == {"forward_lowered_when_the_load_began": True,
                        "forward_compiled_before_the_load": True}
        assert placed == [[]]  # every loaded param as lowered on
        assert counter.compiled_names.count("jit(forward)") == 1  # until ready
        assert eng.background_warmup is not None and eng.background_warmup.wait(600)
        assert eng.background_warmup.status()["error"] is None
    finally:
        eng.shutdown()


def test_placed_otherwise_names_a_param_placed_differently():
    import jax.numpy as jnp

    stage = background_warmup.FirstStage.__new__(background_warmup.FirstStage)
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    stage.placed = {"a": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=where),
                    "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=where)}
    loaded = {"a": jnp.zeros((4, 8), jnp.float32), "b": jnp.zeros((8,), jnp.bfloat16)}
    assert stage.placed_otherwise(jax.device_put(loaded, where)) == []
    loaded["b"] = jnp.zeros((8,), jnp.float32)
    assert stage.placed_otherwise(jax.device_put(loaded, where)) == ["['b']"]
