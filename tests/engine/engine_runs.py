"""Helpers of the tests that compare an engine's outputs before and after its weights change
(weight updates, the RL surface): the prompts, greedy settings and sequential runs."""

from __future__ import annotations

import asyncio

PROMPTS = ["The capital of France is Paris, and the capital of Germany is Berlin; the capital of Italy is",
           "Count with me: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]  # 31, 56 tokens
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
TIMEOUT_S = 60


def req(text, sp, **kw):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    return GenerateReqInput(text=text, sampling_params=dict(sp), **kw)


async def final(engine, obj):
    return [o async for o in engine.generate_request(obj)][-1]


def run_each(engine, prompts=PROMPTS, sp=GREEDY):
    """Final outputs of ``prompts`` run one after another (same batches on every engine)."""
    async def run():
        return [await asyncio.wait_for(final(engine, req(p, sp, return_logprob=True)), TIMEOUT_S)
                for p in prompts]
    return asyncio.run(run())


def tokens_and_logprobs(outs):
    return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]
