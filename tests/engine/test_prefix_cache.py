"""The prefix cache in the real engine (tiny model, fp32): outputs and prompt logprobs equal a
cache-less engine's, also with a pool small enough to force evictions and retractions; a
repeated 1,000-token prompt prefills only the tokens after the last snapshot; the pools
return to idle after every test and are empty after a flush.

GDN chunk size is 64 tokens and pages hold 16, so the shared prefixes below end mid-page,
exactly on a page, and past one and several GDN chunks.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=16, chunked_prefill_size=64, context_length=1280, page_size=16,
            dtype="float32", skip_warmup=True, random_seed=0)
LOGPROB_ATOL = 1e-4  # fp32; the cache changes where prefill chunks start (float rounding only)


def random_ids(seed: int, n: int, lo: int, hi: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[lo, hi)`` by one seeded generator."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    on = Engine(ServerArgs(**ARGS))
    off = Engine(ServerArgs(**ARGS, disable_radix_cache=True))
    yield on, off
    on.shutdown()
    off.shutdown()


def assert_idle_then_flush(eng: Engine, timeout=30.0) -> None:
    """Requests hold nothing (cached pages count as free); after a flush nothing is held."""
    deadline = time.monotonic() + timeout
    while eng.pool_stats()["num_running"] or eng.pool_stats()["num_queued"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s = eng.pool_stats()
    assert (s["kv_pages_used"], s["state_slots_used"]) == (0, 0), s
    assert eng.flush_cache() is True
    s = eng.pool_stats()
    assert (s["kv_pages_cached"], s["gdn_snapshots_used"]) == (0, 0), s
    assert all(p.page_pool.num_used == 0 and p.state_pool.num_used == 0 for p in eng.scheduler.pools)


def serve(eng: Engine, waves: list[list[dict]]) -> list[dict]:
    """Final outputs of each wave's requests (a wave's requests run concurrently)."""
    async def one(kw):
        return [o async for o in eng.generate_request(GenerateReqInput(**kw))][-1]

    async def run():
        out = []
        for wave in waves:
            out += await asyncio.gather(*(one(kw) for kw in wave))
        return out

    return asyncio.run(run())


def greedy(ids, max_new=6, **kw) -> dict:
    return dict(input_ids=ids, sampling_params={"max_new_tokens": max_new, "temperature": 0,
                                                "ignore_eos": True}, **kw)


def assert_same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    ma, mb = a["meta_info"], b["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        ea, eb = ma.get(key, []), mb.get(key, [])
        assert [e[1] for e in ea] == [e[1] for e in eb]
        for x, y in zip(ea, eb):
            assert (x[0] is None) == (y[0] is None)
            if x[0] is not None:
                assert abs(x[0] - y[0]) <= LOGPROB_ATOL, (key, x, y)


def shared_prefix_waves(seed: int, lengths, max_new=6) -> list[list[dict]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 1200) for _ in range(max(lengths) + 8)]
    reqs = []
    for i, k in enumerate(lengths):
        ids = base[:k] + [rng.randrange(3, 1200) for _ in range(i % 5)]
        if i % 3 == 0:
            kw = dict(return_logprob=True, logprob_start_len=max(0, len(ids) - 6))
        elif i % 3 == 1:
            kw = dict(return_logprob=True, logprob_start_len=0)
        else:
            kw = {}
        reqs.append(greedy(ids, max_new, **kw))
    return [reqs[::2], reqs[1::2]]


LENGTHS = [15, 16, 17, 64, 65, 100, 128, 130, 200, 200, 47, 48, 49, 129]


def test_outputs_and_prompt_logprobs_equal_without_cache(engines):
    on, off = engines
    waves = shared_prefix_waves(0, LENGTHS)
    before = on.pool_stats()["num_prefill_tokens_total"]
    got, want = serve(on, waves), serve(off, waves)
    for a, b in zip(got, want):
        assert_same(a, b)
    cached = [o["meta_info"]["cached_tokens"] for o in got]
    assert sum(cached) >= 500 and all(o["meta_info"]["cached_tokens"] == 0 for o in want)
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in got)
    assert on.pool_stats()["num_prefill_tokens_total"] - before == prompt_tokens - sum(cached)
    assert_idle_then_flush(on)
    assert_idle_then_flush(off)


def test_small_pool_evicts_and_retracts_and_stays_exact(engines):
    _, off = engines
    small = Engine(ServerArgs(**ARGS, max_total_tokens=24 * 16, max_gdn_snapshots=4))
    try:
        lengths = [70, 130, 71, 150, 16, 130, 97, 140, 64, 66]
        waves = shared_prefix_waves(1, lengths, max_new=48)
        waves = [waves[0], waves[1][:2], waves[1][2:]]
        got, want = serve(small, waves), serve(off, waves)
        for a, b in zip(got, want):
            assert_same(a, b)
        s = small.pool_stats()
        assert s["num_retracted_total"] > 0 and s["kv_pages_evicted_total"] > 0, s
        assert sum(o["meta_info"]["cached_tokens"] for o in got) > 0
        assert_idle_then_flush(small)
    finally:
        small.shutdown()
    assert_idle_then_flush(off)


def test_repeated_1000_token_prompt_prefills_only_the_tail(engines):
    on, _ = engines
    ids = random_ids(7, 1000, 3, 1200)
    outs, prefilled = [], []
    for _ in range(2):
        before = on.pool_stats()["num_prefill_tokens_total"]
        outs += serve(on, [[greedy(ids, 4)]])
        prefilled.append(on.pool_stats()["num_prefill_tokens_total"] - before)
    last_snapshot = (1000 - 1) // 16 * 16  # 992
    assert prefilled == [1000, 1000 - last_snapshot]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, last_snapshot]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    # Eight samples of a new prompt at once: the first prefills it, the others reuse it.
    ids2 = ids[:500] + ids[::-1][:300]
    before = on.pool_stats()["num_prefill_tokens_total"]
    samples = [dict(input_ids=ids2, sampling_params={"max_new_tokens": 4, "temperature": 1.0,
                                                     "seed": s, "ignore_eos": True})
               for s in range(8)]
    outs = serve(on, [samples])
    last = (800 - 1) // 16 * 16  # 784
    shared = 448  # the deepest snapshot of the first prompt within the 500 shared tokens
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [shared] + [last] * 7
    assert on.pool_stats()["num_prefill_tokens_total"] - before == (800 - shared) + 7 * (800 - last)
    assert_idle_then_flush(on)


def test_flush_while_running_frees_in_use_entries_on_release(engines):
    on, _ = engines
    ids = random_ids(8, 100, 3, 1200)
    serve(on, [[greedy(ids, 1)]])

    async def run():
        gen = on.generate_request(GenerateReqInput(**greedy(ids, 40), stream=True))
        first = await gen.__anext__()  # holds the cached prefix now
        assert on.flush_cache() is True
        assert on.pool_stats()["kv_pages_cached"] > 0  # in use: detached, not freed
        async for out in gen:
            first = out
        return first

    out = asyncio.run(run())
    assert out["meta_info"]["cached_tokens"] == 96 and len(out["output_ids"]) == 40
    assert on.pool_stats()["kv_pages_cached"] == 0
    assert_idle_then_flush(on)
