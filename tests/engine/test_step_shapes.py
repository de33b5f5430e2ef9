"""Steady-state serving never recompiles: after warm-up, varied traffic lowers no program at all
(counted with ``jax.monitoring``), every step has one of the bucketed shapes warm-up compiles
(``ModelRunner.all_shapes``) and samples with one of its sampler variants
(``ModelRunner.sampler_variants``)."""

from __future__ import annotations

import asyncio
import random

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_executor.step_buckets import bucket_ladder, pick_bucket, step_shapes


def test_bucket_ladder_and_pick():
    assert bucket_ladder(64) == (8, 16, 32, 64)
    assert bucket_ladder(48) == (8, 16, 32, 48)
    assert bucket_ladder(64, factor=4) == (8, 32, 64)
    assert bucket_ladder(4) == (4,)
    assert [pick_bucket((8, 16, 32), n) for n in (1, 8, 9, 32)] == [8, 8, 16, 32]


def test_step_shapes_of_the_default_limits():
    """64 running requests, 256-token steps: 3 decode shapes, 2 mixed ones (EXTEND steps
    run as MIXED: one program for both; prefill steps pad their requests to the limit); few
    enough to compile in under a minute."""
    shapes = step_shapes(64, 256)
    D, M = ForwardMode.DECODE, ForwardMode.MIXED
    assert shapes == [(D, 8, 8, 8), (D, 32, 32, 32), (D, 64, 64, 64),
                      (M, 64, 64, 64), (M, 256, 64, 64)]
    # A limit below the smallest bucket is the only bucket; a step larger than the limit
    # never exists, so no bucket exceeds it.
    assert step_shapes(4, 32) == [(D, 4, 4, 4), (M, 32, 4, 4)]


def test_no_compilation_after_warmup(clean_engine):
    """Prompts of 1-90 tokens, 1-20 outputs, greedy and sampled, penalties, logit biases,
    prompt and top logprobs, stop strings, a regex, repeated prompts (prefix-cache hits): after warm-up not
    one program is lowered, and every step has a warm-up shape."""
    runner = clean_engine.runner
    runner.warmup(progress=False)
    seen: list[tuple] = []
    sampled: list[tuple] = []
    real_forward, real_sample = runner.forward, runner.sample

    def recording_forward(fbs, from_slot=None):
        fb, = fbs
        seen.append((fb.mode, fb.input_ids.shape[0], fb.kv_lens.shape[0],
                     fb.logits_indices.shape[0], fb.page_table.shape[1]))
        return real_forward(fbs, from_slot)

    def recording_sample(logits, inp, K, variant):
        sampled.append((K, variant, inp.bitmask is None))
        return real_sample(logits, inp, K, variant)

    rng = random.Random(7)
    objs = []
    for i in range(40):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 90))]
        sp = {"max_new_tokens": rng.randint(1, 20), "temperature": (i % 3) * 0.5,
              "ignore_eos": True}
        if i % 4 == 1:
            sp.update(top_k=5, top_p=0.9, min_p=0.05)
        if i % 6 == 2:
            sp.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
        if i % 7 == 3:
            sp.update(stop=["ab"], min_new_tokens=2)
        if i % 8 == 4:
            sp.update(logit_bias={str(rng.randrange(3, 1000)): 5.0, "7": -100})
        if i == 5:
            sp = {"max_new_tokens": 8, "regex": "[0-9]{3,8}"}
        objs.append(GenerateReqInput(
            input_ids=ids, return_logprob=(i % 5 == 0), logprob_start_len=0 if i % 5 == 0 else -1,
            top_logprobs_num=3 if i % 10 == 0 else 0, sampling_params=sp))
    objs += [GenerateReqInput(input_ids=list(o.input_ids), sampling_params={"max_new_tokens": 3})
             for o in objs[:8]]  # prefix-cache hits

    async def run_all():
        async def one(o):
            return [x async for x in clean_engine.generate_request(o)][-1]
        return await asyncio.gather(*(one(o) for o in objs))

    runner.forward, runner.sample = recording_forward, recording_sample
    counter = CompileCounter()
    try:
        outs = asyncio.run(run_all())
    finally:
        runner.forward, runner.sample = real_forward, real_sample
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
    assert counter.lowerings == 0, f"{counter.lowerings} programs lowered after warm-up"
    warm = set(runner.all_shapes())
    assert seen, "no step ran"
    for mode, T, R, L, P in seen:
        assert (mode, T, R, L) in warm, f"step shape {(mode.name, T, R, L)} is not warmed up"
        assert P == runner.pages_per_seq
    variants = runner.sampler_variants()
    for K, variant, no_mask in sampled:
        assert variant in variants and K in (0, runner.max_top_logprobs_num)
        assert no_mask == (not variant.mask)
