"""Speculative decoding with --dp-size 4 --ep-size 4 vs a plain --dp-size 1 engine (run as a
script).

Run by tests/engine/test_speculative.py in a subprocess with 4 simulated CPU devices (fixed
before jax starts). The DP engine (NGRAM, k = 3, warmed up) serves 48 concurrent greedy
requests of 1 to 50 prompt tokens (with logprobs) twice:
with its NGRAM drafter, and with drafts replaying the plain engine's continuation (a wrong one
at a varying position, so most tokens come from accepted drafts). Then a NEXTN DP engine
(the MTP layer drafting on every rank, warmed up) and a NEXTN one-device engine serve them
once each, recording the MTP drafts every request holds at each proposal. Writes JSON: the
outputs (tokens and their logprobs) of each run, their requests' accept lengths (NEXTN: verify steps), the programs
lowered while serving, the NEXTN drafts on which the two engines differ (and how many they
share), how many requests each rank admitted, and the final pool stats.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.drafter import CallbackDrafter

ARGS = dict(max_running_requests=16, chunked_prefill_size=64, context_length=128, page_size=16,
            dtype="float32", random_seed=0, skip_warmup=True)
K = 3
NUM_REQUESTS = 48


def requests(tag: str) -> list[GenerateReqInput]:
    rng = random.Random(0)
    out = []
    for i in range(NUM_REQUESTS):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 50))]
        out.append(GenerateReqInput(rid=f"{tag}{i}", input_ids=ids, return_logprob=True, sampling_params={
            "max_new_tokens": rng.randint(2, 16), "temperature": 0, "ignore_eos": True}))
    return out


def serve(engine, tag: str) -> list[dict]:
    async def one(obj):
        return [o async for o in engine.generate_request(obj)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in requests(tag)))

    return asyncio.run(run_all())


def logprobs(outputs: list[dict]) -> list[list[float]]:
    """Each output's sampled-token logprobs."""
    return [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]


class DraftRecorder:
    """Wraps an engine's drafter: the MTP drafts each request holds, by (request index,
    sequence length), at every proposal."""

    def __init__(self, engine):
        self.inner, self.seen = engine.scheduler.drafter, {}
        engine.scheduler.drafter = self

    def propose(self, reqs, k):
        for r in reqs:
            self.seen[f"{r.rid[1:]}/{r.num_fill}"] = list(r.draft_state)
        return self.inner.propose(reqs, k)


def serve_nextn(args: dict, tag: str) -> tuple[list[dict], int, dict]:
    """A NEXTN engine of ``args`` serves the requests: (outputs, programs lowered while
    serving, the recorded drafts)."""
    engine = Engine(ServerArgs(speculative_algorithm="NEXTN", speculative_num_draft_tokens=K + 1,
                               **args))
    recorder = DraftRecorder(engine)
    counter = CompileCounter()
    got = serve(engine, tag)
    lowerings = counter.lowerings
    engine.shutdown()
    return got, lowerings, recorder.seen


def wait_idle(engine, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = engine.pool_stats()
        if s["num_running"] == 0 and s["kv_pages_used"] == 0 or time.monotonic() > deadline:
            return s


def main(out_path: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    plain = Engine(ServerArgs(**ARGS))
    plain_out = serve(plain, "p")
    ref = [o["output_ids"] for o in plain_out]
    plain.shutdown()
    spec = Engine(ServerArgs(dp_size=4, ep_size=4, speculative_algorithm="NGRAM",
                             speculative_num_draft_tokens=K + 1, **{**ARGS, "skip_warmup": False}))
    result = {"ref": ref, "ref_logprobs": logprobs(plain_out)}
    counter = CompileCounter()
    ngram = serve(spec, "n")
    result["ngram"] = [o["output_ids"] for o in ngram]
    result["ngram_logprobs"] = logprobs(ngram)
    reference = {f"r{i}": ids for i, ids in enumerate(ref)}

    def replay(req, k):
        o = len(req.output_ids)
        drafts = list(reference[req.rid][o:o + k])
        j = (o + len(req.prompt_ids)) % (K + 2)  # the first wrong draft (>= K: none)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % 1000
        return drafts

    spec.scheduler.drafter = CallbackDrafter(replay)
    replayed = serve(spec, "r")
    result["replay"] = [o["output_ids"] for o in replayed]
    result["replay_logprobs"] = logprobs(replayed)
    result["replay_accept"] = [o["meta_info"]["spec_accept_length"] for o in replayed]
    result["lowerings"] = counter.lowerings
    result["stats"] = wait_idle(spec)
    result["admitted"] = [r["num_admitted_total"] for r in result["stats"]["dp_ranks"]]
    spec.shutdown()
    got, result["nextn_lowerings"], dp_drafts = serve_nextn(
        dict(dp_size=4, ep_size=4, **{**ARGS, "skip_warmup": False}), "x")
    result["nextn"] = [o["output_ids"] for o in got]
    result["nextn_logprobs"] = logprobs(got)
    result["nextn_verify_ct"] = [o["meta_info"]["spec_verify_ct"] for o in got
                                 if len(o["output_ids"]) > 1]
    _, _, one_drafts = serve_nextn(ARGS, "y")
    shared = sorted(set(dp_drafts) & set(one_drafts))
    result["nextn_drafts_shared"] = len(shared)
    result["nextn_drafts_differ"] = [k for k in shared if dp_drafts[k] != one_drafts[k]]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
