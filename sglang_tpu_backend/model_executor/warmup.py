"""Warm-up: compile every program a runner can serve with before the first request.

``runner`` is the ``ModelRunner`` (``model_runner.py``, which calls this module; not imported
here, so the two do not import each other). Every step bucket (``step_buckets``) of the
forward, each with every sampler variant (``sampling.sampler.VARIANTS``) and top-logprob count
(0, max_top_logprobs_num), the penalty row program and the GDN snapshot copies. A TARGET_VERIFY
bucket (speculative decoding) warms the verify forward once, the verify sampler (every variant
and top-logprob count, on scratch penalty state) and the commit. Under NEXTN each bucket also
warms its MTP pass and chain (``nextn_step.py``) on the forward's hidden states. With
multi-step decoding (``runner.num_scheduler_steps`` N > 1) each DECODE bucket also warms its
one N-step program (``multistep.py``: every sampler variant a branch of it), without top
logprobs (requests that ask for them decode one step at a time: ``multistep_policy``). Same
jitted functions, same argument shapes and placements as serving, so serving reuses every
program compiled here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_executor import multistep, parallel_compile
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode, dummy_batch
from sglang_tpu_backend.model_executor.sampler_state import dummy_sampling_inputs
from sglang_tpu_backend.model_executor.verify_step import dummy_verify_inputs


logger = logging.getLogger(__name__)


def warm_multistep(runner: Any, T: int, R: int, L: int) -> None:
    """Compile the multi-step program of DECODE bucket (T, R, L) (every sampler variant a
    branch of it; no top logprobs), on an all-padding batch (writes no page, slot or penalty
    row), placed as serving places its batches."""
    (fb,), _ = runner.place_batch([dummy_batch(ForwardMode.DECODE, T, R, L,
                                               runner.pages_per_seq)], None)
    multistep.dispatch(runner, fb, multistep.dummy_inputs(runner, R, L),
                       runner.num_scheduler_steps, 0)
    jax.block_until_ready(runner.cache)


def warm_up(runner: Any, progress: bool = True, compile_threads: int = 1,
            shapes: list | None = None, precompiled: bool = False) -> float:
    """Compile every forward and sampler program of ``runner`` (or of ``shapes`` only: a
    staged warm-up's first stage, ``background_warmup.py``); returns seconds taken.
    ``precompiled``: ``shapes``' step programs are compiled already (``FirstStage``).

    With ``compile_threads`` > 1 (one device), ``parallel_compile`` first compiles the
    forward, sampler and multi-step programs side by side; the runs below then compile only
    what it does not cover. Otherwise the forward programs compile one after another on this
    thread (each runs on the real cache, which it donates); each bucket's sampler programs
    then compile on a second thread, against scratch copies of the penalty counts and last
    tokens, while the next forward compiles.
    """
    from tqdm import tqdm

    shapes = runner.all_shapes() if shapes is None else shapes
    t0 = time.perf_counter()
    if compile_threads > 1 and parallel_compile.supported(runner):
        parallel_compile.precompile(runner, [] if precompiled else shapes, compile_threads)
    D, state = runner.dp_size, runner.sampler
    scratch = [jnp.copy(state.counts), jnp.copy(state.last_tokens)]

    def warm_sampler(logits, R: int, L: int) -> None:
        for variant in runner.sampler_variants():
            inp = runner.place_sampling(
                dummy_sampling_inputs(D * R, D * L, runner.vocab_size, variant))
            for K in (0, runner.max_top_logprobs_num):
                _, scratch[0], scratch[1] = state.sample_with(logits, *scratch, inp, K, variant)
        jax.block_until_ready(scratch)

    def warm_verify_sampler(logits, R: int):
        out = None
        for variant in runner.sampler_variants():
            spec = dummy_verify_inputs(D * R, runner.num_drafts, runner.vocab_size, variant.mask)
            inp = dataclasses.replace(dummy_sampling_inputs(D * R, D * R, runner.vocab_size,
                                                            variant), bitmask=spec.bitmask)
            for K in (0, runner.max_top_logprobs_num):
                out, scratch[0], scratch[1] = state.verify_with(logits, *scratch, spec, inp, K,
                                                                variant)
        jax.block_until_ready(scratch)
        return out

    with ThreadPoolExecutor(1, thread_name_prefix="warmup-sampler") as pool:
        pending = []
        for kind, T, R, L in tqdm(shapes, desc="warmup (compile)", disable=not progress):
            fbs = [dummy_batch(kind, T, R, L, runner.pages_per_seq)] * D
            if kind.is_verify():  # the forward once, its sampler per variant, the commit once
                logits, states = runner.verify_forward(fbs)
                out = pool.submit(warm_verify_sampler, logits, R).result()
                slots = np.concatenate([fb.state_slots for fb in fbs])
                runner.cache = runner.backend.commit(runner.params, runner.cache, states, slots,
                                                     out["accepted_len"])
                if runner.nextn is not None:
                    runner.nextn.warm_up(runner.params, fbs, runner.last_hidden, out["tokens"],
                                         out["accepted_len"])
                continue
            logits = runner.forward(fbs)
            pending.append(pool.submit(warm_sampler, logits, R, L))
            if kind == ForwardMode.DECODE and runner.num_scheduler_steps > 1:
                warm_multistep(runner, T, R, L)
            if runner.nextn is not None:  # (the backend places the sampled tokens)
                runner.nextn.warm_up(runner.params, fbs, runner.last_hidden,
                                     np.zeros(D * R, np.int32), np.ones(D * R, np.int32))
        for f in pending:
            f.result()  # re-raises a failed sampler compile here
    state.clear_row(0)  # slot 0 is free at warm-up
    if runner.snapshots is not None:
        runner.cache = runner.snapshots.warmup(runner.cache)
    jax.block_until_ready(runner.cache)
    dt = time.perf_counter() - t0
    logger.info("warmup compiled %d step shapes in %.1f s", len(shapes), dt)
    return dt
