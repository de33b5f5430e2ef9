"""Routed experts with --dp-size 4 --ep-size 4 and EPLB's redundant expert slots (run as a
script by tests/engine/test_routed_experts.py, 4 CPU devices).

The engine (f32, flag on) serves concurrent greedy requests (two prompts longer than a
prefill chunk), then the first prompt again (a prefix-cache hit), then (cache flushed) every
prompt through a PD handover within the engine (prefill, state exported, installed on the
least-loaded DP rank, decoded there); writes JSON: per request its prompt, output ids,
``meta_info["routed_experts"]`` and cached_tokens. The test compares the ids with the
router's top-k recomputed on one device.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=8, chunked_prefill_size=32, context_length=128, page_size=16,
            dtype="float32", random_seed=0, skip_warmup=True, enable_return_routed_experts=True)
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (40, 7, 19, 1, 33)]


def serve(engine, batch: list[list[int]], handover: bool = False) -> list[dict]:
    """Each prompt served with its routed experts; with ``handover`` prefilled, handed over
    and decoded by ``engine`` (DP rank to DP rank)."""
    async def stream(obj):
        if not handover:
            return engine.generate_request(obj)
        _, h = await engine.prefill_for_handover(obj)
        return engine.generate_from_handover(h)

    async def one(ids):
        obj = GenerateReqInput(input_ids=ids, sampling_params=dict(SAMPLING),
                               return_routed_experts=True)
        out = [o async for o in await stream(obj)][-1]
        return {"prompt": ids, "output_ids": out["output_ids"],
                "routed": out["meta_info"]["routed_experts"],
                "cached": out["meta_info"]["cached_tokens"]}

    async def run_all():
        return await asyncio.gather(*(one(ids) for ids in batch))

    return asyncio.run(run_all())


def main(out_path: str) -> None:
    engine = Engine(ServerArgs(**ARGS, dp_size=4, ep_size=4, ep_num_redundant_experts=4))
    try:
        result = {"first": serve(engine, prompts()), "again": serve(engine, prompts()[:1])}
        engine.flush_cache()
        result["handover"] = serve(engine, prompts(), handover=True)
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
