"""``--enable-deterministic-inference``: in bf16 a request's tokens are the same alone or in a
batch of 48 (greedy and seeded sampling, prompts over one prefill chunk and one GDN chunk,
mixed output lengths, some requests aborted mid-way). The control shows, on the model, what
the default mode varies with the batch and that it changes bf16 logits.

The scheduling rules (aligned prefill chunks, no mixed steps, fixed shapes) are checked
directly on the Scheduler / ModelRunner as well, without running the model.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from sglang_tpu_backend.managers.io_struct import GenerateReqInput

ARGS = dict(max_running_requests=48, chunked_prefill_size=64, context_length=256, page_size=16,
            max_total_tokens=48 * 256, dtype="bfloat16", skip_warmup=True, random_seed=0)
PROMPT_LENS = (3, 9, 20, 40, 70, 130)  # 70 and 130 span several 64-token chunks
ABORT_AFTER = {5: 2, 17: 1, 30: 3, 41: 2}  # request index -> outputs read before leaving


def make_requests(n: int, seed: int = 0) -> list[dict]:
    """``n`` request specs: prompt ids, sampling params (even: greedy; odd: seeded draws)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 1000) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])]
        sp = {"max_new_tokens": rng.randint(1, 8), "ignore_eos": True, "temperature": 0.0}
        if i % 2:
            sp.update(temperature=0.8, seed=1000 + i, top_p=0.95 if i % 3 else 1.0)
        out.append({"ids": ids, "sp": sp})
    return out


async def run_one(engine, spec: dict, leave_after: int | None = None) -> list[int]:
    """Output ids of one request; with ``leave_after`` stream it and stop reading (abort)
    once that many tokens arrived."""
    obj = GenerateReqInput(input_ids=spec["ids"], sampling_params=dict(spec["sp"]),
                           stream=leave_after is not None)
    ids: list[int] = []
    gen = engine.generate_request(obj)
    try:
        async for o in gen:
            ids = o["output_ids"]
            if leave_after is not None and len(ids) >= leave_after:
                break
    finally:
        await gen.aclose()
    return ids


def alone_and_batched(engine, specs, abort_after=None):
    """Each request run alone (one after the other), then all at once. Returns both output
    lists and the programs lowered during the batched run."""
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    abort_after = abort_after or {}

    async def main():
        alone = [await run_one(engine, s) for s in specs]
        counter = CompileCounter()
        batched = await asyncio.gather(*(run_one(engine, s, abort_after.get(i))
                                         for i, s in enumerate(specs)))
        return alone, batched, counter.lowerings

    return asyncio.run(main())


@pytest.fixture(scope="module")
def det_engine():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**ARGS, enable_deterministic_inference=True))
    yield eng
    eng.shutdown()


def test_48_concurrent_requests_equal_their_runs_alone(det_engine):
    specs = make_requests(48)
    runner, seen_shapes = det_engine.runner, set()
    real_forward = runner.forward

    def recording_forward(fbs, from_slot=None):
        fb, = fbs
        seen_shapes.add((fb.mode, fb.input_ids.shape[0], fb.kv_lens.shape[0],
                         fb.logits_indices.shape[0]))
        return real_forward(fbs, from_slot)

    runner.forward = recording_forward
    try:
        alone, batched, lowered = alone_and_batched(det_engine, specs, ABORT_AFTER)
    finally:
        runner.forward = real_forward
    for i, (a, b) in enumerate(zip(alone, batched)):
        if i in ABORT_AFTER:  # left early: what it got is the start of its run alone
            assert ABORT_AFTER[i] <= len(b) < len(a) and b == a[:len(b)], (i, a, b)
        else:
            assert b == a, (i, specs[i]["sp"], a, b)
    assert len(alone[0]) == specs[0]["sp"]["max_new_tokens"]
    stats = det_engine.pool_stats()
    assert stats["num_retracted_total"] == 0  # a retraction would re-prefill (see README)
    assert stats["kv_pages_cached"] == 0  # prefix cache off
    assert seen_shapes <= set(det_engine.runner.all_shapes())  # only the two fixed shapes ran
    assert len(seen_shapes) == 2
    assert lowered == 0  # the runs alone compiled every program the batch needed


@pytest.fixture(scope="module")
def tiny_bf16():
    from sglang_tpu_backend.config import load_model_config
    from sglang_tpu_backend.model_loader.loader import load_params
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    import jax.numpy as jnp

    cfg = load_model_config(default_model_path())
    return cfg, load_params(default_model_path(), cfg, dtype=jnp.bfloat16)


def last_logits(tiny_bf16, steps, T, R=8):
    """Run ``steps`` (each a list of (token ids, start position, slot)) on a fresh cache in
    buckets (T, R); the next-token logits of slot 0's chunk in the last step, f32[V]."""
    import jax.numpy as jnp
    import numpy as np

    from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
    from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
    from sglang_tpu_backend.models import qwen3_5_moe

    cfg, params = tiny_bf16
    cache = qwen3_5_moe.init_cache(cfg, num_pages=64, page_size=16, num_state_slots=8,
                                   kv_dtype=jnp.bfloat16)
    for chunks in steps:
        seqs = [SeqChunk(ids, start, list(range(8 * slot, 8 * slot + 8)), slot)
                for ids, start, slot in chunks]
        fb, rows = build_forward_batch(seqs, page_size=16, mode=ForwardMode.MIXED, num_tokens=T,
                                       num_seqs=R, pages_per_seq=8, num_logits=R)
        logits, cache = qwen3_5_moe.forward_jit(params, cache, fb, cfg=cfg, impl="auto")
    mine = [slot for _, _, slot in steps[-1]].index(0)
    return np.asarray(logits)[rows[mine][-1]]


def test_what_the_default_mode_varies_changes_bf16_logits(tiny_bf16):
    """Control, at the model level (the engine-level one costs minutes: measured without the
    flag, 9 of 48 requests of such traffic differed from their runs alone). An 80-token
    prompt's next-token logits in bf16:
      * are bit-identical when other requests share its steps, at a fixed step shape with its
        chunks ending on the 64-token grid (what deterministic mode schedules);
      * change when a shared token budget cuts its prefill off the grid (40 + 60), and when
        a short prompt runs in a different token bucket (T=16 alone, T=64 beside others): the
        two things the default mode varies with the batch."""
    import numpy as np

    rng = random.Random(1)
    A, B, C = ([rng.randrange(3, 1000) for _ in range(n)] for n in (80, 9, 30))
    grid = [[(A[:64], 0, 0)], [(A[64:], 64, 0)]]
    ref = last_logits(tiny_bf16, grid, T=64)
    shared = [[(A[:64], 0, 0)], [(C, 0, 2), (A[64:], 64, 0), (B[:3], 0, 3)]]
    assert (last_logits(tiny_bf16, shared, T=64) == ref).all()
    off_grid = [[(A[:40], 0, 0)], [(A[40:], 40, 0)]]
    assert not (last_logits(tiny_bf16, off_grid, T=64) == ref).all()
    gen = np.random.default_rng(0)  # a 9-token prompt measured to round differently at T=16
    gen.integers(3, 1000, 40)
    short = [[([int(t) for t in gen.integers(3, 1000, 9)], 0, 0)]]
    assert not (last_logits(tiny_bf16, short, T=16) == last_logits(tiny_bf16, short, T=64)).all()


# Scheduling rules, host-side only ------------------------------------------------------------


def test_aligned_chunks_and_no_mixed_steps():
    """A 130-token prompt prefills in chunks ending at 64 and 128 whatever the budget left,
    a step holds decodes or prefill chunks, never both, and at most 8 prefill chunks."""
    from sglang_tpu_backend.managers.schedule_batch import ChunkResult, Req
    from sglang_tpu_backend.managers.scheduler import Scheduler
    from sglang_tpu_backend.mem_cache.rank_pools import RankPools
    from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
    from sglang_tpu_backend.sampling.sampling_params import SamplingParams

    pools = RankPools.per_rank(1, num_pages=256, page_size=16, num_slots=16)
    sched = Scheduler(pools, max_running_requests=16, max_tokens_per_step=64,
                      prefill_align=64, max_prefill_chunks=8, max_logits_rows=64)

    def req(rid, n, max_new=3):
        return Req(rid, list(range(3, 3 + n)), SamplingParams(), max_new_tokens=max_new, seed=0,
                   eos_ids=frozenset(), context_length=1024)

    def step():
        batch = sched.schedule()
        sched.on_launch(batch)
        res = [ChunkResult(next_token=5, logprob=0.0) if c.sample else ChunkResult()
               for c in batch.chunks]
        sched.process_result(batch, res)
        return batch

    short = req("short", 20)
    sched.add_request(short)
    b = step()  # 20 tokens: the whole prompt
    assert [(c.start, c.num_tokens) for c in b.chunks] == [(0, 20)]
    long = req("long", 130)
    sched.add_request(long)
    for k in range(12):
        sched.add_request(req(f"r{k}", 3))
    b = step()  # prefill only (the short request's decode waits); 64 - 0 budget used by long
    assert b.kind == ForwardMode.EXTEND and all(c.req is not short for c in b.chunks)
    assert [(c.start, c.num_tokens) for c in b.chunks if c.req is long] == [(0, 64)]
    assert len(b.chunks) == 1  # the budget is gone: no other prefill
    ends = []
    while sched.waiting or not all(r.is_decode_ready for r in sched.running):
        b = step()
        assert b.kind == ForwardMode.EXTEND and len(b.chunks) <= 8
        ends += [c.start + c.num_tokens for c in b.chunks if c.req is long]
    assert ends == [128, 130]  # never cut at the budget, only on the 64 grid or the end
    assert step().kind == ForwardMode.DECODE


def test_deterministic_shapes_and_flag_validation():
    from sglang_tpu_backend.kernels import gdn
    from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
    from sglang_tpu_backend.model_executor.step_buckets import deterministic_shapes
    from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK, ServerArgs

    # chunk ends on the 64 grid are on every GDN path's chunk grid (Pallas 64, XLA 32)
    assert DETERMINISTIC_MIN_CHUNK % gdn.CHUNK_SIZE == 0
    assert DETERMINISTIC_MIN_CHUNK % gdn.XLA_CHUNK_SIZE == 0
    assert deterministic_shapes(64, 256) == [(ForwardMode.DECODE, 64, 64, 64),
                                             (ForwardMode.MIXED, 256, 8, 64)]
    assert deterministic_shapes(128, 256)[1] == (ForwardMode.MIXED, 256, 8, 128)
    assert deterministic_shapes(4, 64) == [(ForwardMode.DECODE, 4, 4, 4),
                                           (ForwardMode.MIXED, 64, 4, 64)]
    with pytest.raises(ValueError, match="--chunked-prefill-size 32 with --enable-deterministic"):
        ServerArgs(chunked_prefill_size=32, enable_deterministic_inference=True)
    assert ServerArgs(enable_deterministic_inference=True).num_gdn_snapshots_per_rank == 0
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    on = ServerArgs.from_cli_args(parser.parse_args(["--enable-deterministic-inference"]))
    assert on.enable_deterministic_inference and not ServerArgs().enable_deterministic_inference
