"""Routed experts (``--enable-return-routed-experts``, ``return_routed_experts``): SGLang's
``meta_info["routed_experts"]`` (base64 int32 [prompt + output - 1, moe_layers, top_k]) holds
the router's top-k recomputed layer by layer from the model (``routed_reference.py``): for
prompt and output tokens, chunked prefills, concurrent requests, prefix-cache hits, after
warm-up without compiling, with --dp-size 4 --ep-size 4 and EPLB's redundant slots (a
subprocess on 4 CPU devices, also through a DP rank-to-rank PD handover); through the
prefill -> decode handover equal to the colocated engine's; off by default (no key, no other
programs, requests refused).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.cpu_devices import run_on_cpu_devices
from tests.engine.conftest import ENGINE_ARGS, serving

HERE = Path(__file__).resolve().parent
SAMPLING = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def routed_engine():
    yield from serving({**ENGINE_ARGS, "max_running_requests": 8, "skip_warmup": False,
                        "enable_return_routed_experts": True})


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("routed_dp") / "out.json"
    run_on_cpu_devices(HERE / "routed_dp_run.py", str(out), num_devices=4)
    return json.loads(out.read_text())


def _generate(engine, prompts, sp=SAMPLING, **kw):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    async def one(ids):
        obj = GenerateReqInput(input_ids=ids, sampling_params=dict(sp), **kw)
        return [o async for o in engine.generate_request(obj)][-1]

    async def run():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    return asyncio.run(run())


def _check(engine, prompt, output_ids, encoded):
    """``encoded`` is the router's top-k of prompt + output_ids[:-1] (recomputed)."""
    from sglang_tpu_backend.model_executor.routed_experts import decode
    from tests.engine.routed_reference import reference_routed

    cfg = engine.model_config
    got = decode(encoded, cfg.num_hidden_layers, cfg.num_experts_per_tok)  # every layer MoE
    seq = list(prompt) + list(output_ids[:-1])
    assert got.shape == (len(seq), cfg.num_hidden_layers, cfg.num_experts_per_tok)
    want = reference_routed(engine.runner.params, cfg, seq, engine.args.page_size)
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 0 and got.max() < cfg.num_experts  # logical ids


def _prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def test_routed_experts_match_the_router_and_compile_nothing(routed_engine):
    """Concurrent requests (one prompt over the 64-token prefill chunk, a 1-token prompt),
    then the first again (a prefix-cache hit: the cached tokens' ids come from the KV
    location store): each request's ids equal the recomputed router top-k; after warm-up
    nothing is lowered."""
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    prompts = _prompts((90, 1, 23, 40))
    counter = CompileCounter()
    outs = _generate(routed_engine, prompts, return_routed_experts=True)
    again = _generate(routed_engine, prompts[:1], return_routed_experts=True)[0]
    assert counter.lowerings == 0, f"{counter.lowerings} programs lowered after warm-up"
    for ids, out in zip(prompts, outs):
        _check(routed_engine, ids, out["output_ids"], out["meta_info"]["routed_experts"])
    assert again["meta_info"]["cached_tokens"] >= 64
    assert again["meta_info"]["routed_experts"] == outs[0]["meta_info"]["routed_experts"]


def test_only_requests_that_ask_get_them_and_offline_engine(routed_engine):
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine

    (plain,) = _generate(routed_engine, _prompts((12,)))
    assert "routed_experts" not in plain["meta_info"]
    offline = OfflineEngine(engine=routed_engine)
    out = offline.generate(input_ids=_prompts((9,), seed=2)[0], sampling_params=dict(SAMPLING),
                           return_routed_experts=True)
    _check(routed_engine, _prompts((9,), seed=2)[0], out["output_ids"],
           out["meta_info"]["routed_experts"])


async def _retracted_after_five(eng, stream) -> list:
    """Every chunk of ``stream`` (one streamed request on ``eng``), its request retracted
    (``pause_generation("retract")``, one request) after 5 chunks and then continued."""
    import time

    outs: list = []

    async def consume():
        async for o in stream:
            outs.append(o)

    task = asyncio.ensure_future(consume())
    deadline = time.monotonic() + 60
    while len(outs) < 5:
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
    res = await asyncio.to_thread(eng.pause_generation, "retract")
    assert res["num_retracted"] == 1
    eng.continue_generation()
    await asyncio.wait_for(task, 60)
    return outs


def test_streamed_request_retracted_midway(routed_engine):
    """A streamed request retracted mid-generation (``pause_generation("retract")``, then
    re-prefilled with its outputs so far): the final chunk's ids are the router top-k of its
    prompt + outputs (the re-prefill's rows replace the first ones); earlier chunks carry none."""
    import time

    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    eng, prompt = routed_engine, _prompts((30,), seed=4)[0]
    sp = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}

    async def run():
        obj = GenerateReqInput(input_ids=prompt, sampling_params=sp, stream=True,
                               return_routed_experts=True)
        return await _retracted_after_five(eng, eng.generate_request(obj))

    eng.fault_injector = lambda phase: time.sleep(0.02) if phase == "schedule" else None
    try:
        outs = asyncio.run(run())
    finally:
        eng.fault_injector = None
    assert all("routed_experts" not in o["meta_info"] for o in outs[:-1])
    assert len(outs[-1]["output_ids"]) == 30
    _check(eng, prompt, outs[-1]["output_ids"], outs[-1]["meta_info"]["routed_experts"])


@pytest.fixture(scope="module")
def routed_decode_engine():
    """A decode-role engine with the flag (the prefill side is ``routed_engine``)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**ENGINE_ARGS, enable_return_routed_experts=True), role="decode")
    yield eng
    eng.shutdown()


def _handover(prefill, decode, obj):
    """prefill -> handover -> decode: (the handover, the final output)."""
    async def run():
        first, h = await prefill.prefill_for_handover(obj)
        assert h is not None, first
        return h, [o async for o in decode.generate_from_handover(h)][-1]

    return asyncio.run(run())


@pytest.mark.parametrize("sp", [SAMPLING, {"temperature": 0.8, "max_new_tokens": 6,
                                           "ignore_eos": True, "seed": 11}])
def test_prefill_decode_handover_equals_colocated(routed_engine, routed_decode_engine, sp):
    """prefill -> handover -> decode returns the colocated engine's tokens and routed experts
    (decoded: bit-equal): the handover carries the prompt's rows i32[P, M, K], the decode
    side appends the output tokens'. Prompts: over the 64-token prefill chunk, one page and
    a bit, one token. Then the first again: a prefix-cache hit on the prefill side (the
    cached prefix's rows come from its store)."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.model_executor.routed_experts import decode

    cfg = routed_engine.model_config
    M, K = cfg.num_hidden_layers, cfg.num_experts_per_tok
    prompts = _prompts((90, 23, 1), seed=7)
    refs = _generate(routed_engine, prompts, sp, return_routed_experts=True)
    routed_engine.flush_cache()  # the handover's prefill computes the prompt
    for ids, ref in zip(prompts, refs):
        obj = GenerateReqInput(input_ids=ids, sampling_params=dict(sp), return_routed_experts=True)
        h, out = _handover(routed_engine, routed_decode_engine, obj)
        want = decode(ref["meta_info"]["routed_experts"], M, K)
        assert h.routed_experts.dtype == np.int32 and h.routed_experts.shape == (len(ids), M, K)
        np.testing.assert_array_equal(h.routed_experts, want[:len(ids)])
        assert out["output_ids"] == ref["output_ids"]
        np.testing.assert_array_equal(decode(out["meta_info"]["routed_experts"], M, K), want)
    _check(routed_engine, prompts[0], refs[0]["output_ids"], refs[0]["meta_info"]["routed_experts"])

    obj = GenerateReqInput(input_ids=prompts[0], sampling_params=dict(sp), return_routed_experts=True)
    h, hit = _handover(routed_engine, routed_decode_engine, obj)  # prefill-side prefix hit
    assert h.cached_tokens >= 64
    assert hit["meta_info"]["routed_experts"] == refs[0]["meta_info"]["routed_experts"]
    assert hit["output_ids"] == refs[0]["output_ids"]


def test_handover_retracted_on_the_decode_side(routed_engine, routed_decode_engine):
    """A handed-over request retracted midway on the decode engine (re-prefilled there with
    its outputs so far: those rows replace the carried ones) still returns the colocated
    engine's tokens and routed experts."""
    import time

    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    dec, prompt = routed_decode_engine, _prompts((30,), seed=9)[0]
    sp = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    (ref,) = _generate(routed_engine, [prompt], sp, return_routed_experts=True)

    async def run():
        obj = GenerateReqInput(input_ids=prompt, sampling_params=sp, stream=True,
                               return_routed_experts=True)
        _, h = await routed_engine.prefill_for_handover(obj)
        return (await _retracted_after_five(dec, dec.generate_from_handover(h)))[-1]

    dec.fault_injector = lambda phase: time.sleep(0.02) if phase == "schedule" else None
    try:
        out = asyncio.run(run())
    finally:
        dec.fault_injector = None
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["routed_experts"] == ref["meta_info"]["routed_experts"]


def test_handover_without_rows_or_flag_is_refused(routed_engine, routed_decode_engine, engine):
    """The decode side refuses (naming the field) a handover asking for routed experts that
    carries none, and asking on a decode engine without the flag; the prompt's rows ride in
    the handover's metadata, not in its cache state (``nbytes``)."""
    import dataclasses

    from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError

    obj = GenerateReqInput(input_ids=_prompts((20,), seed=8)[0], sampling_params=dict(SAMPLING),
                           return_routed_experts=True)
    _, h = asyncio.run(routed_engine.prefill_for_handover(obj))
    assert h.nbytes == h.kv.nbytes + h.conv.nbytes + h.rec.nbytes
    for eng, bad in ((routed_decode_engine, dataclasses.replace(h, routed_experts=None)),
                     (engine, h)):
        async def run():
            return [o async for o in eng.generate_from_handover(bad)]

        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(run())
        assert err.value.field == "return_routed_experts"


def test_dp4_ep4_with_redundant_experts_match_the_router(dp_results, routed_engine):
    """--dp-size 4 --ep-size 4 --ep-num-redundant-experts 4 (physical slots != logical ids):
    every request's ids equal the router's top-k recomputed on one device, also on a prefix hit."""
    for r in dp_results["first"] + dp_results["again"]:
        _check(routed_engine, r["prompt"], r["output_ids"], r["routed"])
    hit = dp_results["again"][0]
    assert hit["cached"] >= 32 and hit["routed"] == dp_results["first"][0]["routed"]


def test_dp4_ep4_handover_equals_colocated(dp_results):
    """The same engine's prompts through a PD handover (prefill, export, install on a DP
    rank, decode): the same tokens and routed experts (logical ids under EPLB)."""
    for pd, ref in zip(dp_results["handover"], dp_results["first"], strict=True):
        assert pd["prompt"] == ref["prompt"] and pd["output_ids"] == ref["output_ids"]
        assert pd["routed"] == ref["routed"]


def test_off_by_default(engine):
    """Without the flag: the step programs are the ones without routed ids (``with_stats``
    True, as before the feature), meta_info has no key, and asking is refused naming the field."""
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError

    assert engine.runner.backend.with_stats is True and engine.runner.routed is None
    (out,) = _generate(engine, _prompts((6,)))
    assert "routed_experts" not in out["meta_info"]

    async def ask():
        obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params=dict(SAMPLING),
                               return_routed_experts=True)
        return [o async for o in engine.generate_request(obj)]

    with pytest.raises(InvalidRequestError, match="return_routed_experts") as err:
        asyncio.run(ask())
    assert err.value.field == "return_routed_experts"
