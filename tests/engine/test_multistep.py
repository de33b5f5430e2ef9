"""Multi-step decoding (``--num-scheduler-steps N``) gives exactly the outputs of single steps.

An engine with N = 4 serves the same traffic as the shared engine (N = 1): tokens, text and
finish reasons equal, whether a request stops at max_new_tokens (not a multiple of N), at a
stop token id or a stop string met in the middle of a 4-step launch, or at EOS. Requests that
need host work per token (a grammar) make their steps single ones; logprob requests run
multi-step and get the same logprobs. Pools are empty after every test; warm-up compiles the
multi-step program, so serving compiles nothing."""

from __future__ import annotations

import pytest

from sglang_tpu_backend.managers.io_struct import GenerateReqInput

from tests.engine.conftest import ENGINE_ARGS, drained, serving, wait_pools_empty
from tests.engine.test_overlap import _run, _same, _traffic

N = 4


@pytest.fixture(scope="module")
def ms_engine():
    yield from serving(dict(ENGINE_ARGS, num_scheduler_steps=N))


@pytest.fixture
def clean_ms(ms_engine):
    yield from drained(ms_engine)


def _record_launches(engine):
    """Wrap the runner's ``launch``: returns the list each launched batch is appended to (its
    ``in_flight`` set: every chunk's input token was in flight at launch)."""
    runner, launched = engine.runner, []
    real = runner.launch

    def launch(batch):
        batch.in_flight = all(c.input_in_flight for c in batch.chunks)
        launched.append(batch)
        return real(batch)

    runner.launch = launch
    return launched, lambda: setattr(runner, "launch", real)


def _greedy(prompt_lens, max_new, **extra):
    return [GenerateReqInput(input_ids=[3 + (11 * i + 7 * j) % 900 for j in range(n)],
                             sampling_params={"temperature": 0, "max_new_tokens": m, **extra})
            for i, (n, m) in enumerate(zip(prompt_lens, max_new))]


PROMPT_LENS = [1, 5, 17, 40, 9, 70]
MAX_NEW = [1, 3, 6, 9, 13, 22]  # mostly not multiples of N


def test_greedy_lengths_equal_single_steps(clean_engine, clean_ms):
    want = _run(clean_engine, _greedy(PROMPT_LENS, MAX_NEW, ignore_eos=True))
    launched, restore = _record_launches(clean_ms)
    try:
        got = _run(clean_ms, _greedy(PROMPT_LENS, MAX_NEW, ignore_eos=True))
    finally:
        restore()
    for g, w, m in zip(got, want, MAX_NEW):
        _same(g, w)
        assert len(g["output_ids"]) == m
    assert any(b.num_steps == N for b in launched)
    # Overlap stays on: a multi-step launch whose inputs are the previous launch's tokens.
    assert clean_ms.overlap
    assert any(b.num_steps == N and b.in_flight for b in launched)
    assert wait_pools_empty(clean_ms)["kv_pages_used"] == 0


def test_stop_ids_and_strings_mid_launch(clean_engine, clean_ms):
    """Stop token ids and stop strings taken from the single-step outputs at positions 2, 5
    and 6 (inside a 4-step launch): both engines stop at the same token, same text."""
    base = _run(clean_engine, _greedy(PROMPT_LENS, [24] * 6, ignore_eos=True))
    objs = []
    for i, b in enumerate(base):
        o = _greedy([PROMPT_LENS[i]], [24], ignore_eos=True)[0]
        o.input_ids = _greedy(PROMPT_LENS, [24] * 6)[i].input_ids
        at = (2, 5, 6)[i % 3]
        if i % 2 == 0:
            o.sampling_params["stop_token_ids"] = [b["output_ids"][at]]
        elif len(b["text"]) > 2:
            o.sampling_params["stop"] = [b["text"][len(b["text"]) // 3:][:2]]
        objs.append(o)
    want = _run(clean_engine, objs)
    launched, restore = _record_launches(clean_ms)
    try:
        got = _run(clean_ms, [GenerateReqInput(input_ids=o.input_ids,
                                               sampling_params=dict(o.sampling_params))
                              for o in objs])
    finally:
        restore()
    for g, w in zip(got, want):
        _same(g, w)
    assert sum(w["meta_info"]["finish_reason"]["type"] == "stop" for w in want) >= 3
    assert any(b.num_steps == N for b in launched)


def test_eos_mid_launch(clean_engine, clean_ms):
    """Without ignore_eos: EOS ends the request wherever it falls in a launch (the tiny
    model's own EOS never comes up, so both engines take tokens of a base run as EOS ids)."""
    base = _run(clean_engine, _greedy(PROMPT_LENS, [24] * 6, ignore_eos=True))
    eos = frozenset(b["output_ids"][(3, 6)[i % 2]] for i, b in enumerate(base))
    saved = clean_engine.requests.eos_ids, clean_ms.requests.eos_ids
    clean_engine.requests.eos_ids = clean_ms.requests.eos_ids = eos
    try:
        want = _run(clean_engine, _greedy(PROMPT_LENS, [24] * 6))
        got = _run(clean_ms, _greedy(PROMPT_LENS, [24] * 6))
    finally:
        clean_engine.requests.eos_ids, clean_ms.requests.eos_ids = saved
    for g, w in zip(got, want):
        _same(g, w)
    assert sum(w["meta_info"]["finish_reason"]["type"] == "stop" for w in want) >= 3


def test_mixed_traffic_equals_single_steps(clean_engine, clean_ms):
    """Seeded sampling, filters, penalties, stop strings with min_new_tokens, a regex,
    logprobs and top logprobs (``test_overlap``'s traffic): equal outputs. Sampling is keyed
    per (seed, output index), so seeded draws match too."""
    want = _run(clean_engine, _traffic(3, 24))
    launched, restore = _record_launches(clean_ms)
    try:
        got = _run(clean_ms, _traffic(3, 24))
    finally:
        restore()
    for g, w in zip(got, want):
        _same(g, w)
    for b in launched:  # a grammar or a pending min_new_tokens ban: single steps
        if any(c.req.grammar is not None
               or c.req.num_sampled < c.req.sampling.min_new_tokens for c in b.chunks):
            assert b.num_steps == 1


def test_grammar_request_falls_back(clean_engine, clean_ms):
    def objs():
        return _greedy([8, 12], [12, 12], ignore_eos=True) + [GenerateReqInput(
            input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                  "regex": "[a-c]{2,6}x"})]

    want = _run(clean_engine, objs())
    launched, restore = _record_launches(clean_ms)
    try:
        got = _run(clean_ms, objs())
    finally:
        restore()
    for g, w in zip(got, want):
        _same(g, w)
    grammar = [b for b in launched if any(c.req.grammar is not None for c in b.chunks)]
    assert grammar and all(b.num_steps == 1 for b in grammar)


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_per_step(clean_engine, clean_ms, top):
    """Logprobs of every output token come back from a multi-step launch; seeded draws equal
    the single steps' (sampling is keyed per (seed, output index)). Top logprobs are not in the
    multi-step programs: a batch asking for them decodes one step at a time, with the same
    outputs."""
    def objs():
        return [GenerateReqInput(input_ids=[9 + i, 8, 7], return_logprob=True,
                                 top_logprobs_num=top * (i % 2),
                                 sampling_params={"temperature": 0.7 * (i % 2), "seed": i,
                                                  "max_new_tokens": 11, "ignore_eos": True})
                for i in range(4)]

    want = _run(clean_engine, objs())
    launched, restore = _record_launches(clean_ms)
    try:
        got = _run(clean_ms, objs())
    finally:
        restore()
    for g, w in zip(got, want):
        _same(g, w)
        assert len(g["meta_info"]["output_token_logprobs"]) == 11
    sampled = [b for b in launched if any(c.req.sampling.temperature > 0 for c in b.chunks)]
    if top:  # top logprobs: never a multi-step launch
        assert sampled and all(b.num_steps == 1 for b in sampled)
    else:  # seeded draws ran in multi-step launches (and still equal the single steps' draws)
        assert any(b.num_steps == N for b in sampled)


def test_num_scheduler_steps_must_be_positive():
    import argparse

    from sglang_tpu_backend.server_args import TPU_SCHEDULER_STEPS, ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match="--num-scheduler-steps must be a positive integer"):
            ServerArgs.from_cli_args(parser.parse_args(["--num-scheduler-steps", bad]))
    args = ServerArgs.from_cli_args(parser.parse_args(["--num-scheduler-steps", "8"]))
    assert args.num_scheduler_steps == 8 and ServerArgs().num_scheduler_steps is None
    assert ServerArgs().scheduler_steps("tpu") == TPU_SCHEDULER_STEPS > 1
    assert ServerArgs().scheduler_steps("cpu") == 1 == ServerArgs(
        num_scheduler_steps=1).scheduler_steps("tpu")


def test_no_compilation_after_warmup():
    """Warm-up compiles the N-step program of every DECODE bucket: serving lowers nothing."""
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    for eng in serving(dict(ENGINE_ARGS, max_running_requests=8, num_scheduler_steps=N)):
        eng.runner.warmup(progress=False)
        objs = _greedy([3, 20, 7], [9, 14, 5], ignore_eos=True) + [GenerateReqInput(
            input_ids=[4, 5], return_logprob=True,
            sampling_params={"temperature": 0.8, "top_k": 5, "frequency_penalty": 0.3,
                             "max_new_tokens": 10, "seed": 1})]
        counter = CompileCounter()
        launched, restore = _record_launches(eng)
        try:
            outs = _run(eng, objs)
        finally:
            restore()
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert any(b.num_steps == N for b in launched)
        assert counter.lowerings == 0, f"{counter.lowerings} programs lowered after warm-up"
        assert wait_pools_empty(eng)["kv_pages_used"] == 0


@pytest.mark.parametrize("flag", ["enable_deterministic_inference",
                                  "enable_return_routed_experts"])
def test_unsupported_layouts_run_single_steps(flag):
    """Deterministic inference (batch invariance) and the routed-expert store (every step's
    routed ids) keep single steps: the scheduler is told N = 1."""
    for eng in serving(dict(ENGINE_ARGS, max_running_requests=8, num_scheduler_steps=N,
                            **{flag: True})):
        assert eng.runner.num_scheduler_steps == 1 == eng.scheduler.num_scheduler_steps
        out = _run(eng, _greedy([5], [6], ignore_eos=True))[0]
        assert len(out["output_ids"]) == 6


def test_streaming_sees_several_tokens_per_step(clean_engine, clean_ms):
    """A streamed request gets one output per launch, N tokens more each (cumulative, each
    a prefix of the final one, logprobs included); the final equals N = 1's."""
    kw = dict(input_ids=[5, 9, 17, 33, 65], return_logprob=True,
              sampling_params={"max_new_tokens": 14, "temperature": 0.8, "seed": 7,
                               "ignore_eos": True})

    async def collect(eng):
        return [o async for o in eng.generate_request(GenerateReqInput(stream=True, **kw))]

    import asyncio

    chunks = asyncio.run(collect(clean_ms))
    want = _run(clean_engine, [GenerateReqInput(**kw)])[0]
    _same(chunks[-1], want)
    lens = [len(c["output_ids"]) for c in chunks]
    assert any(b - a == N for a, b in zip(lens, lens[1:])), lens
    last = chunks[-1]["meta_info"]
    for c in chunks:
        n = len(c["output_ids"])
        assert c["output_ids"] == chunks[-1]["output_ids"][:n]
        assert c["meta_info"]["output_token_logprobs"] == last["output_token_logprobs"][:n]


def test_advance_batch_moves_real_rows_only():
    """The next iteration's DECODE batch: sampled tokens become the real rows' input ids,
    their positions and KV lengths + 1; padding rows (and an invalid row's id) unchanged."""
    import jax.numpy as jnp
    import numpy as np

    from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
    from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
    from sglang_tpu_backend.model_executor.multistep import advance_batch

    fb, _ = build_forward_batch([SeqChunk([5], 20, [1, 2], 0), SeqChunk([6], 33, [3, 4, 5], 1)],
                                page_size=16, mode=ForwardMode.DECODE, num_tokens=4,
                                num_seqs=4, pages_per_seq=4, num_logits=4)
    import jax

    nxt = advance_batch(jax.tree.map(jnp.asarray, fb), jnp.array([70, 71, 72, 73]), jnp.array([True, False, False, False]))
    np.testing.assert_array_equal(nxt.input_ids, [70, 6, 0, 0])
    np.testing.assert_array_equal(nxt.positions, [21, 34, 0, 0])
    np.testing.assert_array_equal(nxt.kv_lens, [22, 35, 0, 0])
