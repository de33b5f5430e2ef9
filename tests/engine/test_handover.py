"""Prefill -> decode handover between two engines: same greedy output as one engine.

The shared tiny engine prefills (``prefill_for_handover``: prompt + first token, KV pages and
GDN states copied out); a second engine installs the state (``generate_from_handover``) and
decodes. Prompts span several KV pages (16 tokens) and several GDN chunks (64 tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from tests.engine.conftest import ENGINE_ARGS, wait_pools_empty

PROMPT_LENS = (5, 16, 110)  # 110: 7 pages, 2 GDN chunks (context 128)
MAX_NEW = 12


@pytest.fixture(scope="module")
def decode_engine():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**ENGINE_ARGS), role="decode")
    yield eng
    eng.shutdown()


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(n + salt).integers(3, 1000, size=n)]


async def _collect(agen) -> list[dict]:
    return [out async for out in agen]


async def _disaggregated(prefill, decode, obj):
    first, h = await prefill.prefill_for_handover(obj)
    if h is None:
        return [first], None
    return [first] + await _collect(decode.generate_from_handover(h)), h


@pytest.mark.parametrize("n", PROMPT_LENS)
@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0, "repetition_penalty": 1.3}])
def test_handover_matches_one_engine(engine, decode_engine, n, params):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(n), sampling_params=dict(params, max_new_tokens=MAX_NEW,
                                                                      ignore_eos=True))
    ref = asyncio.run(_collect(engine.generate_request(dataclasses.replace(obj))))[-1]
    engine.flush_cache()  # the handover prefill must compute the prompt, not reuse it
    outs, h = asyncio.run(_disaggregated(engine, decode_engine, obj))
    assert h is not None and h.num_computed == n and len(h.output_ids) == 1
    cfg = engine.model_config
    assert h.kv.shape[:2] == (len(cfg.attention_layers), -(-n // 16))
    assert h.conv.shape[0] == h.rec.shape[0] == len(cfg.linear_layers)
    assert h.nbytes == h.kv.nbytes + h.conv.nbytes + h.rec.nbytes
    last = outs[-1]
    assert last["output_ids"] == ref["output_ids"]
    assert last["text"] == ref["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert last["meta_info"]["completion_tokens"] == MAX_NEW
    for eng in (engine, decode_engine):
        s = wait_pools_empty(eng)
        assert s["state_slots_used"] == 0 and s["num_running"] == 0


def test_handover_streams_and_reports_metrics(engine, decode_engine):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(40, 1), stream=True,
                           sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    outs, h = asyncio.run(_disaggregated(engine, decode_engine, obj))
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3, 4, 5]
    text = decode_engine.metrics_text().decode()
    assert 'sglang:kv_transfer_bytes_total{model_name=' in text and 'role="decode"' in text
    line = next(x for x in text.splitlines() if x.startswith("sglang:kv_transfer_bytes_total"))
    assert float(line.split()[-1]) >= h.nbytes
    assert "sglang:kv_transfer_latency_seconds_count" in text


def test_handover_reports_the_prefill_sides_cached_tokens(engine, decode_engine):
    """A prompt whose prefix the prefill engine has cached: the decode side's outputs report
    the cached prompt tokens the prefill side reused (usage's ``cached_tokens``), not 0."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    ids = _prompt(110, 3)
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    asyncio.run(_collect(engine.generate_request(GenerateReqInput(input_ids=ids, sampling_params=sp))))
    outs, h = asyncio.run(_disaggregated(engine, decode_engine,
                                         GenerateReqInput(input_ids=ids, sampling_params=sp)))
    cached = outs[0]["meta_info"]["cached_tokens"]
    assert cached >= 64  # at least one GDN chunk reused
    assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [cached] * (len(outs) - 1)
    assert h.cached_tokens == cached


def test_first_token_finish_needs_no_handover(engine):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(20, 2), sampling_params={"max_new_tokens": 1, "temperature": 0})
    first, h = asyncio.run(engine.prefill_for_handover(obj))
    assert h is None and first["meta_info"]["finish_reason"]["type"] == "length"
    assert wait_pools_empty(engine)["state_slots_used"] == 0


def test_handover_rejects_other_page_size(engine, decode_engine):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError

    obj = GenerateReqInput(input_ids=_prompt(20, 3), sampling_params={"max_new_tokens": 4, "temperature": 0})
    _, h = asyncio.run(engine.prefill_for_handover(obj))
    h = dataclasses.replace(h, page_size=32)
    with pytest.raises(InvalidRequestError, match="page_size"):
        asyncio.run(_collect(decode_engine.generate_from_handover(h)))


def test_decode_consumer_exit_frees_installed_request_at_once(engine, decode_engine):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(40, 4), stream=True,
                           sampling_params={"max_new_tokens": 60, "temperature": 0, "ignore_eos": True})

    async def go():
        _, h = await engine.prefill_for_handover(obj)
        gen = decode_engine.generate_from_handover(h)
        first = await gen.__anext__()
        assert first["meta_info"]["finish_reason"] is None
        await gen.aclose()
        return decode_engine.pool_stats()

    stats = asyncio.run(go())
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0


def test_handover_waiting_for_room_times_out(engine, decode_engine, monkeypatch):
    """A handed-over request that finds no free pages / slot on the decode engine waits at
    most ``--handover-wait-timeout``, then ends with finish_reason abort and a message (no
    hang, nothing left installed, the failure counted). "No room" is forced by refusing
    admission, as a full pool does."""
    import time

    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(20, 2),
                           sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    _, h = asyncio.run(engine.prefill_for_handover(obj))
    assert h is not None
    monkeypatch.setattr(decode_engine.handover, "wait_timeout", 0.5)
    attempts = []  # the loop's admission attempts while the handover waits
    monkeypatch.setattr(decode_engine.scheduler, "admit_installed",
                        lambda req: attempts.append(req) and False)
    t0 = time.monotonic()
    outs = asyncio.run(asyncio.wait_for(_collect(decode_engine.generate_from_handover(h)), 30))
    waited = time.monotonic() - t0
    # It waits on the loop's wake condition until its deadline, not in a polling spin (which
    # made ~500 attempts in these 0.5 s).
    assert 1 <= len(attempts) <= 5, len(attempts)
    reason = outs[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "--handover-wait-timeout" in reason["message"], reason
    assert 0.5 <= waited < 10, waited
    assert not decode_engine.handover.pending
    s = wait_pools_empty(decode_engine)
    assert s["state_slots_used"] == 0 and s["kv_pages_used"] == 0
    text = decode_engine.metrics_text().decode()
    line = [l for l in text.splitlines() if l.startswith("sglang:kv_transfer_failures_total")]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 1, line


def test_handover_from_other_weights_is_aborted(engine, decode_engine):
    """A handover computed with other weights than the decode engine serves ends with an abort
    naming both weight versions; nothing is installed."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=_prompt(30, 5),
                           sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    _, h = asyncio.run(engine.prefill_for_handover(obj))
    assert h.weight_version == engine.weight_version == decode_engine.weight_version
    outs = asyncio.run(_collect(decode_engine.generate_from_handover(
        dataclasses.replace(h, weight_version="v-other"))))
    reason = outs[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "'v-other'" in reason["message"], reason
    assert repr(decode_engine.weight_version) in reason["message"]
    s = wait_pools_empty(decode_engine)
    assert s["state_slots_used"] == 0 and s["kv_pages_used"] == 0 and s["num_running"] == 0


# Speculative decoding on the decode side ------------------------------------------------------
@pytest.fixture(scope="module")
def ngram_decode_engine():
    """A decode engine verifying NGRAM drafts (the prefill side, ``engine``, runs none)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs
    from tests.engine.test_speculative import SPEC

    eng = Engine(ServerArgs(**{**ENGINE_ARGS, "max_running_requests": 16, **SPEC}), role="decode")
    yield eng
    eng.shutdown()


def _run_disaggregated(prefill, decode, objs) -> list[dict]:
    """Each request's last output through prefill -> decode, all concurrently."""
    async def one(o):
        outs, _ = await _disaggregated(prefill, decode, o)
        return outs[-1]

    async def go():
        return await asyncio.gather(*(one(o) for o in objs))
    return asyncio.run(go())


def test_ngram_decode_replica_matches_one_engine(engine, ngram_decode_engine):
    """48 greedy requests of mixed lengths (a third repeat a pattern): a plain prefill replica
    -> an NGRAM decode replica give the one-engine non-speculative tokens and logprobs. The
    tiny random model's continuations never repeat earlier text, so NGRAM proposes (almost)
    nothing on it: the same requests then run with drafts replaying the plain continuation
    (one wrong token at a varying position), which verifies drafts on every handed-over
    request and must keep the outputs."""
    from tests.engine.test_speculative import (
        K,
        assert_same_outputs,
        drafts_from,
        fresh,
        replay_drafts,
        run_all,
        workload,
    )

    objs = workload(5)
    want = run_all(engine, objs)
    assert_same_outputs(_run_disaggregated(engine, ngram_decode_engine, fresh(objs, "pd")), want)
    reference = {f"r{o.rid}": w["output_ids"] for o, w in zip(objs, want)}
    replay = replay_drafts(reference, lambda req, o: (o + len(req.prompt_ids)) % (K + 2))
    with drafts_from(ngram_decode_engine, replay):
        got = _run_disaggregated(engine, ngram_decode_engine, fresh(objs, "r"))
    assert_same_outputs(got, want)
    # One-token requests end on the (non-speculative) prefill side: no spec_verify_ct there.
    handed = [g for g in got if len(g["output_ids"]) > 1]
    assert handed and all(g["meta_info"]["spec_verify_ct"] > 0 for g in handed)
    assert np.mean([g["meta_info"]["spec_accept_length"] for g in handed]) > 1.5
    for eng in (engine, ngram_decode_engine):
        s = wait_pools_empty(eng)
        assert s["state_slots_used"] == 0 and s["kv_pages_used"] == 0 and s["num_running"] == 0


def test_ngram_drafts_from_the_handed_over_tokens(engine, ngram_decode_engine):
    """The decode replica's NGRAM drafter indexes the prompt and first token that came with
    the handover: a pattern prompt whose first token restarts the pattern gets the pattern's
    continuation as drafts at once."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    pattern = [7, 8, 9, 10, 11]
    obj = GenerateReqInput(input_ids=pattern * 4, sampling_params={
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    _, h = asyncio.run(engine.prefill_for_handover(obj))
    req = ngram_decode_engine.requests.build_from_handover(dataclasses.replace(h, output_ids=[7]))
    drafts, = ngram_decode_engine.scheduler.drafter.propose([req], 3)
    assert drafts == [8, 9, 10]
    wait_pools_empty(engine)


@pytest.fixture(scope="module")
def nextn_pair():
    """(prefill, decode) engines both drafting with NEXTN (k = 3): the handover carries the
    MTP KV pages and first drafts."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs
    from tests.engine.test_speculative import K

    args = ServerArgs(**{**ENGINE_ARGS, "max_running_requests": 16,
                         "speculative_algorithm": "NEXTN", "speculative_num_steps": K})
    prefill = Engine(args, role="prefill")
    decode = Engine(args, role="decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_nextn_prefill_to_nextn_decode_matches_one_engine(engine, nextn_pair):
    """48 greedy requests of mixed lengths through NEXTN prefill -> NEXTN decode: the
    one-engine non-speculative tokens and logprobs; handed-over requests verify the drafts
    that came with them (their first decode step can)."""
    from tests.engine.test_speculative import assert_same_outputs, fresh, run_all, workload

    prefill, decode = nextn_pair
    objs = workload(6)
    want = run_all(engine, objs)
    got = _run_disaggregated(prefill, decode, fresh(objs, "pdn"))
    assert_same_outputs(got, want)
    # Random MTP weights: the drafts are rejected and each request's back-off soon holds them
    # back, so a request may decode without a verify step once most of its step's neighbours
    # pause; most handed-over requests verify the drafts that came with them.
    handed = [g["meta_info"]["spec_verify_ct"] for g in got if len(g["output_ids"]) > 1]
    assert handed and sum(ct > 0 for ct in handed) > len(handed) // 2, handed
    for eng in (prefill, decode):
        s = wait_pools_empty(eng)
        assert s["state_slots_used"] == 0 and s["kv_pages_used"] == 0 and s["num_running"] == 0


def test_nextn_handover_carries_the_mtp_kv_and_drafts(engine, nextn_pair):
    """The handover's drafts, and the drafts the decode replica's MTP layers propose at every
    later step (from the MTP KV of the prompt installed at its own page ids), equal the
    plain-JAX MTP reference computed from the sequence alone. Replayed verify drafts (the plain
    engine's continuation, the first wrong one moving through 0..K) vary the accept length."""
    from tests.engine.test_speculative import (
        K,
        RecordingDrafter,
        reference_drafts,
        replay_drafts,
        run_all,
    )
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    prefill, decode = nextn_pair
    prefill.runner.warm_up_state_transfer(gather=True, scatter=False)  # (the MTP KV's too)
    decode.runner.warm_up_state_transfer(gather=False, scatter=True)
    objs = [GenerateReqInput(rid=f"mtp-pd{i}", input_ids=_prompt(n, 7), sampling_params={
        "max_new_tokens": 9, "temperature": 0, "ignore_eos": True})
            for i, n in enumerate((3, 40, 70, 100))]
    reference = {o.rid: w["output_ids"] for o, w in zip(objs, run_all(engine, objs))}
    handovers = [asyncio.run(prefill.prefill_for_handover(dataclasses.replace(o)))[1] for o in objs]
    cfg = prefill.model_config
    for o, h in zip(objs, handovers):
        n = len(o.input_ids)
        assert h.mtp_kv.shape == (cfg.mtp_num_hidden_layers, *h.kv.shape[1:])
        assert h.nbytes == h.kv.nbytes + h.conv.nbytes + h.rec.nbytes + h.mtp_kv.nbytes
        assert h.drafts == reference_drafts(prefill.runner, o.input_ids + h.output_ids, K), n
    recorder = RecordingDrafter(replay_drafts(
        reference, lambda req, o: (o + len(req.prompt_ids)) % (K + 2)))
    sched = decode.scheduler
    with decode.loop.lock:
        own, sched.drafter = sched.drafter, recorder
    try:
        async def go():
            return await asyncio.gather(*(_collect(decode.generate_from_handover(h))
                                          for h in handovers))
        got = [outs[-1] for outs in asyncio.run(go())]
    finally:
        with decode.loop.lock:
            sched.drafter = own
    assert [g["output_ids"] for g in got] == [reference[o.rid] for o in objs]
    seen = {}
    for rid, seq, drafts in recorder.seen:
        seen.setdefault(rid, []).append((seq, drafts))
    assert sorted(seen) == sorted(o.rid for o in objs)
    for o, h in zip(objs, handovers):
        first_seq, first_drafts = seen[o.rid][0]
        assert first_seq == o.input_ids + h.output_ids and first_drafts == h.drafts
        assert len(seen[o.rid]) >= 2
        for seq, drafts in seen[o.rid]:
            assert drafts == reference_drafts(decode.runner, seq, K), (o.rid, len(seq))
    wait_pools_empty(decode)


def test_nextn_decode_refuses_a_handover_without_mtp_kv(engine, nextn_pair):
    """A NEXTN decode replica aborts a handover from a prefill replica that ran without NEXTN
    (no MTP KV to draft from), naming the flag; nothing stays installed."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    _, decode = nextn_pair
    obj = GenerateReqInput(input_ids=_prompt(30, 8), sampling_params={
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    _, h = asyncio.run(engine.prefill_for_handover(obj))
    assert h.mtp_kv is None and h.drafts is None
    outs = asyncio.run(_collect(decode.generate_from_handover(h)))
    reason = outs[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "MTP KV" in reason["message"], reason
    assert "--speculative-algorithm NEXTN" in reason["message"]
    s = wait_pools_empty(decode)
    assert s["state_slots_used"] == 0 and s["kv_pages_used"] == 0


def test_mtp_page_transfer_round_trip_after_warm_up():
    """The MTP KV's export / install: pages written at arbitrary ids come back in list order,
    padding writes nothing, others stay untouched; after warm-up neither lowers a program."""
    import jax.numpy as jnp

    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
    from sglang_tpu_backend.model_executor.state_transfer import StateTransfer

    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.normal(size=(2, 12, 4, 16, 8)), jnp.float32)  # [Lm, N, 2G, page, D]
    before = np.asarray(pool)
    st = StateTransfer(num_pages=10, num_slots=1)  # (the MTP pool's own size pads)
    pool = st.warm_up_mtp(pool, 5, gather=True, scatter=True)
    np.testing.assert_array_equal(np.asarray(pool), before)
    kv = rng.normal(size=(2, 3, 4, 16, 8)).astype(np.float32)
    counter = CompileCounter()
    pool = st.scatter_mtp(pool, kv, [9, 2, 11])
    np.testing.assert_array_equal(st.gather_mtp(pool, [9, 2, 11]), kv)
    assert counter.lowerings == 0
    rest = [p for p in range(12) if p not in (9, 2, 11)]
    np.testing.assert_array_equal(np.asarray(pool)[:, rest], before[:, rest])
    with pytest.raises(ValueError, match="does not fit 2 pages"):
        st.scatter_mtp(pool, kv, [1, 2])
