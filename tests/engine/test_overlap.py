"""Overlap scheduling (the default) gives exactly the outputs of one-step-at-a-time scheduling.

With overlap the engine launches step i+1 before step i's tokens reach the host: decodes read
their input token on the device, a request's length limit counts tokens in flight, a request
with a grammar waits for its token, and a retraction that would hit a request in flight first
completes the running step. These tests run the same traffic both ways."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from sglang_tpu_backend.managers.io_struct import GenerateReqInput

from tests.engine.conftest import ENGINE_ARGS, small_page_pool, wait_pools_empty


@pytest.fixture(scope="module")
def sequential_engine():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**ENGINE_ARGS, disable_overlap_schedule=True))
    yield eng
    eng.shutdown()


def _traffic(seed: int, n: int) -> list[GenerateReqInput]:
    rng = random.Random(seed)
    objs = []
    for i in range(n):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 70))]
        sp = {"max_new_tokens": rng.randint(1, 24), "temperature": (i % 3) * 0.6, "seed": i}
        if i % 4 == 1:
            sp.update(top_k=8, top_p=0.9)
        if i % 5 == 2:
            sp.update(frequency_penalty=0.4, repetition_penalty=1.3)
        if i % 6 == 3:
            sp.update(stop=["e"], min_new_tokens=2)
        if i % 7 == 4:
            sp = {"max_new_tokens": 10, "regex": "[a-c]{2,6}x", "temperature": 0}
        if i % 9 == 5:
            sp["ignore_eos"] = True
        objs.append(GenerateReqInput(input_ids=ids, sampling_params=sp, return_logprob=i % 4 == 0,
                                     top_logprobs_num=2 if i % 8 == 0 else 0))
    return objs


def _run(engine, objs):
    async def one(o):
        return [x async for x in engine.generate_request(o)][-1]

    async def all_():
        return await asyncio.gather(*(one(o) for o in objs))

    return asyncio.run(all_())


def _same(got, want):
    """Tokens, text and finish reason exactly; logprobs within fp32 noise (the two engines
    batch requests differently, and a matmul's rounding depends on its batch)."""
    g, w = got["meta_info"], want["meta_info"]
    assert (got["output_ids"], got["text"], g["finish_reason"]) == (
        want["output_ids"], want["text"], w["finish_reason"])
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert (key in g) == (key in w)
        flat = lambda entries: np.array([e[0] for e in entries] if entries and not isinstance(
            entries[0][0], list) else [x[0] for row in entries for x in row])  # noqa: E731
        if key in g:
            ids = lambda entries: [e[1] if not isinstance(e[0], list) else [x[1] for x in e]
                                   for e in entries]  # noqa: E731
            assert ids(g[key]) == ids(w[key])
            np.testing.assert_allclose(flat(g[key]), flat(w[key]), atol=1e-4)


def test_overlap_is_on_by_default(engine, sequential_engine):
    assert engine.overlap and not sequential_engine.overlap


def test_same_outputs_with_and_without_overlap(clean_engine, sequential_engine):
    objs = _traffic(0, 32)
    want = _run(sequential_engine, objs)
    got = _run(clean_engine, _traffic(0, 32))
    for g, w in zip(got, want):
        _same(g, w)
    assert any(w["meta_info"]["finish_reason"]["type"] == "stop" for w in want)
    assert wait_pools_empty(sequential_engine)["kv_pages_used"] == 0


def test_same_outputs_under_retraction(clean_engine, sequential_engine):
    """A pool of 12 pages for 12 long requests forces retractions, some of requests whose
    token is in flight: the overlapped engine completes the running step first."""
    def objs():
        return [GenerateReqInput(input_ids=[7 + i, 8, 9, 10 + i],
                                 sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                  "ignore_eos": True})
                for i in range(12)]

    with small_page_pool(sequential_engine, 12):
        want = _run(sequential_engine, objs())
    with small_page_pool(clean_engine, 12):
        retracted = clean_engine.scheduler.num_retracted_total
        got = _run(clean_engine, objs())
        assert clean_engine.scheduler.num_retracted_total > retracted
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_prompt_only_request_over_several_chunks(clean_engine, sequential_engine):
    """max_new_tokens=0 with prompt logprobs over two chunks: the request finishes after its
    last chunk, not when the first one completes (by then every chunk is launched)."""
    def objs():
        return [GenerateReqInput(input_ids=[3 + (7 * j + i) % 900 for j in range(120)],
                                 return_logprob=True, logprob_start_len=i * 20,
                                 sampling_params={"max_new_tokens": 0}) for i in range(3)]

    want, got = _run(sequential_engine, objs()), _run(clean_engine, objs())
    for g, w, i in zip(got, want, range(3)):
        assert len(g["meta_info"]["input_token_logprobs"]) == 120 - i * 20
        _same(g, w)
        np.testing.assert_allclose([x[0] for x in g["meta_info"]["input_token_logprobs"][1:]],
                                   [x[0] for x in w["meta_info"]["input_token_logprobs"][1:]],
                                   atol=1e-4)
