"""Disaggregated prefill (--dp-size 4, then --tp-size 4) -> decode (--dp-size 2) on 8 CPU
devices vs one single-device engine (run as a script).

Run by tests/engine/test_dp_handover.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. The prefill engine prefills each request on
one of its 4 ranks and exports that rank's KV pages and GDN states; the decode engine places
the request on the least-loaded of its 2 ranks and installs them there. Writes JSON: the
outputs (ids and logprobs) both ways, both engines' pool stats, and the handover programs'
compile counts after warm-up and after serving.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=16, chunked_prefill_size=64, context_length=256, page_size=16,
            dtype="float32", random_seed=0, skip_warmup=True)
NUM_REQUESTS, MAX_NEW = 24, 8


def requests() -> list[GenerateReqInput]:
    """Greedy requests of 5 to 200 tokens (1 to 13 pages, up to 4 GDN chunks of 64)."""
    rng = random.Random(1)
    out = []
    for i in range(NUM_REQUESTS):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(5, 200))]
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        if i % 5 == 1:
            sp.update(frequency_penalty=0.5, repetition_penalty=1.3)
        out.append(GenerateReqInput(input_ids=ids, sampling_params=sp, return_logprob=True))
    return out


def summary(out: dict) -> dict:
    meta = out["meta_info"]
    return {"ids": out["output_ids"], "finish": meta["finish_reason"],
            "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]]}


def serve_one_engine(engine) -> list[dict]:
    async def one(obj):
        return [o async for o in engine.generate_request(obj)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in requests()))

    return [summary(o) for o in asyncio.run(run_all())]


def serve_disaggregated(prefill, decode) -> list[dict]:
    async def one(obj):
        first, h = await prefill.prefill_for_handover(obj)
        if h is None:
            return first
        return [o async for o in decode.generate_from_handover(h)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in requests()))

    return [summary(o) for o in asyncio.run(run_all())]


def program_counts(prefill, decode) -> list[int]:
    return [prefill.runner.transfer.export_program._cache_size(),
            decode.runner.transfer.install_program._cache_size()]


def main(out_path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    result = {}
    prefill = Engine(ServerArgs(dp_size=4, ep_size=4, **ARGS), role="prefill")
    decode = Engine(ServerArgs(dp_size=2, ep_size=2, **ARGS), role="decode")
    prefill.runner.warm_up_state_transfer(gather=True, scatter=False)
    decode.runner.warm_up_state_transfer(gather=False, scatter=True)
    result["programs_after_warmup"] = program_counts(prefill, decode)
    result["pd_outputs"] = serve_disaggregated(prefill, decode)
    result["programs_after_serving"] = program_counts(prefill, decode)
    result["prefill_stats"] = prefill.pool_stats()
    prefill.shutdown()

    # Tensor-parallel prefill (heads split over 4 devices, the 2 kv heads and 2 GDN key heads
    # replicated twice) to the same DP2 decode engine: the state is converted to whole heads.
    tp = Engine(ServerArgs(tp_size=4, **ARGS), role="prefill")
    result["tp_outputs"] = serve_disaggregated(tp, decode)
    result["tp_stats"] = tp.pool_stats()
    tp.shutdown()
    result["decode_stats"] = decode.pool_stats()
    decode.shutdown()

    single = Engine(ServerArgs(**ARGS))
    result["ref_outputs"] = serve_one_engine(single)
    single.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
