"""Warm-up's compiles side by side: the one-device runner's forward, sampler and multi-step
programs compiled ahead of time (``jitted.lower(...).compile()``) in a thread pool, before
``warmup.warm_up`` runs them one by one; each run then finds its executable in its jit's own
cache and compiles nothing. One forward per bucket, one multi-step program per DECODE bucket
(the sampler variants are branches of it: ``multistep.py``), one sampler per (R, L), sampler
variant and top-logprob count, and the prefix cache's GDN snapshot copies (two per copy
bucket, ``state_snapshots.py``).

XLA compiles outside the GIL, so on a many-core TPU host the programs compile at the same
time; tracing and lowering are Python, so they run one after another on the calling thread,
each program's compile handed to the pool as soon as it is lowered. In that order a nested
jit's trace (the forward inside every multi-step program) is done once and then found in
JAX's trace cache, where threads lowering side by side would all miss it at once and trace
it each (and take turns on the GIL anyway). Each task lowers the same jitted
function with the same argument values (the runner's params, cache and sampler state; batches
placed as serving places them; committed zero logits standing in for a forward's) and the
same static arguments as the warm-up's call, so the cache keys agree:
``tests/engine/test_parallel_compile.py`` counts the compiles the warm-up still does.

One device only (``SingleDeviceBackend``), without NEXTN; the TARGET_VERIFY shapes and the
DP / TP backends keep compiling in the warm-up loop. With one worker thread there is nothing
to overlap and the warm-up runs as before.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import numpy as np

from sglang_tpu_backend.model_executor import multistep
from sglang_tpu_backend.model_executor.backends import SingleDeviceBackend
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode, dummy_batch
from sglang_tpu_backend.model_executor.sampler_state import dummy_sampling_inputs

logger = logging.getLogger(__name__)

MAX_AUTO_THREADS = 8  # each compile holds its own XLA working memory

Task = Callable[[], Any]  # returns a jax.stages.Lowered


def compile_threads(requested: int | None) -> int:
    """Worker threads for the warm-up's compiles: ``requested``, or by default one per core
    but one (for the loop that feeds the device), at most ``MAX_AUTO_THREADS``."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"warmup_compile_threads must be >= 1, got {requested}")
        return requested
    return max(1, min(MAX_AUTO_THREADS, (os.cpu_count() or 1) - 1))


def supported(runner: Any) -> bool:
    """Whether ``runner``'s programs can be compiled ahead here (one device, no NEXTN)."""
    return isinstance(runner.backend, SingleDeviceBackend) and runner.nextn is None


def _placed_batch(runner: Any, kind: ForwardMode, T: int, R: int, L: int):
    (fb,), _ = runner.place_batch([dummy_batch(kind, T, R, L, runner.pages_per_seq)], None)
    return fb


def forward_task(runner: Any, kind: ForwardMode, T: int, R: int, L: int) -> Task:
    """Lowers the forward of bucket (kind, T, R, L) on an all-padding placed batch."""
    return lambda: runner.backend.lower_forward(runner.params, runner.cache,
                                                [_placed_batch(runner, kind, T, R, L)])


def sampler_task(runner: Any, R: int, L: int, variant: Any, K: int) -> Task:
    """Lowers the packed sampler of R request rows and L logits rows, one variant and
    top-logprob count, on zero logits f32[L, V] committed to the device."""
    def lower():
        logits = jax.device_put(np.zeros((L, runner.vocab_size), np.float32),
                                runner.backend.device)
        inp = runner.place_sampling(dummy_sampling_inputs(R, L, runner.vocab_size, variant))
        return runner.sampler.lower_sample(logits, inp, K, variant)
    return lower


def multistep_task(runner: Any, T: int, R: int, L: int) -> Task:
    """Lowers the N-step decode program of DECODE bucket (T, R, L): one for every sampler
    variant (its branches), without top logprobs."""
    def lower():
        fb = _placed_batch(runner, ForwardMode.DECODE, T, R, L)
        return multistep.lower_dispatch(runner, fb, multistep.dummy_inputs(runner, R, L),
                                        runner.num_scheduler_steps, 0)
    return lower


def tasks(runner: Any, shapes: list, skip_samplers: frozenset = frozenset()) -> list[Task]:
    """One task per program the warm-up loop would compile for ``shapes`` (verify shapes
    excepted), forwards first (the longest compiles start first); none for the samplers of
    ``skip_samplers``' (R, L) (compiled already)."""
    plain = [s for s in shapes if not s[0].is_verify()]
    out = [forward_task(runner, *s) for s in plain]
    if runner.num_scheduler_steps > 1:  # one per DECODE bucket
        out += [multistep_task(runner, T, R, L) for kind, T, R, L in plain
                if kind == ForwardMode.DECODE]
    variants, counts = runner.sampler_variants(), (0, runner.max_top_logprobs_num)
    out += [sampler_task(runner, R, L, v, K) for R, L in sorted({(s[2], s[3]) for s in plain} - skip_samplers)
            for v in variants for K in counts]
    return out


def precompile(runner: Any, shapes: list, threads: int, snapshots: bool = True,
               first_lowered: Callable[[], None] | None = None) -> int:
    """Lower ``tasks(runner, shapes)`` and (``snapshots``) the prefix cache's snapshot copies
    one by one here and compile them on ``threads`` workers; returns how many programs. A
    failed compile raises here, before any step runs. ``first_lowered`` is called once the
    first program (the longest compile) has been lowered and handed to the pool."""
    todo = tasks(runner, shapes)
    if snapshots and runner.snapshots is not None:
        todo += runner.snapshots.lower_copies(runner.cache)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="warmup-compile") as pool:
        compiling = []
        for i, task in enumerate(todo):
            compiling.append(pool.submit(task().compile))
            if i == 0 and first_lowered is not None:
                first_lowered()
        for f in compiling:
            f.result()  # each executable lives on in its jit's cache
    logger.info("compiled %d programs on %d threads in %.1f s", len(todo), threads,
                time.perf_counter() - t0)
    return len(todo)
