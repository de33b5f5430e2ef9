"""Steady-state serving never recompiles: every step the engine runs has one of the bucketed
shapes that warm-up compiles (``ModelRunner.all_shapes``) and samples with one of its sampler
variants (``ModelRunner.sampler_variants``), whatever the traffic looks like."""

from __future__ import annotations

import asyncio
import random

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.model_runner import bucket_ladder, pick_bucket


def test_bucket_ladder_and_pick():
    assert bucket_ladder(64) == (8, 16, 32, 64)
    assert bucket_ladder(48) == (8, 16, 32, 48)
    assert bucket_ladder(64, factor=4) == (8, 32, 64)
    assert bucket_ladder(4) == (4,)
    assert [pick_bucket((8, 16, 32), n) for n in (1, 8, 9, 32)] == [8, 8, 16, 32]


def test_every_step_shape_is_a_warmup_shape(clean_engine):
    runner = clean_engine.runner
    seen: list[tuple] = []
    sampled: list[tuple] = []
    real_forward, real_sample = runner.forward, runner.sample

    def recording_forward(fb):
        seen.append((fb.mode, fb.input_ids.shape[0], fb.kv_lens.shape[0],
                     fb.logits_indices.shape[0], fb.page_table.shape[1]))
        return real_forward(fb)

    def recording_sample(logits, inp, K, variant):
        sampled.append((K, variant, inp.bitmask is None))
        return real_sample(logits, inp, K, variant)

    rng = random.Random(7)
    objs = []
    for i in range(40):  # mixed prompt lengths, output lengths, prompt logprobs, sampling
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 90))]
        objs.append(GenerateReqInput(
            input_ids=ids, return_logprob=(i % 5 == 0), logprob_start_len=0 if i % 5 == 0 else -1,
            sampling_params={"max_new_tokens": rng.randint(1, 20), "temperature": (i % 3) * 0.5,
                             "ignore_eos": True}))

    async def run_all():
        async def one(o):
            return [x async for x in clean_engine.generate(o)][-1]
        return await asyncio.gather(*(one(o) for o in objs))

    runner.forward, runner.sample = recording_forward, recording_sample
    try:
        outs = asyncio.run(run_all())
    finally:
        runner.forward, runner.sample = real_forward, real_sample
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    warm = set(runner.all_shapes())
    assert seen, "no step ran"
    for mode, T, R, L, P in seen:
        assert (mode, T, R, L) in warm, f"step shape {(mode.name, T, R, L)} is not warmed up"
        assert P == runner.pages_per_seq
    variants = runner.sampler_variants()
    for K, variant, no_mask in sampled:
        assert variant in variants and K in (0, runner.max_top_logprobs_num)
        assert no_mask == (not variant.mask)
