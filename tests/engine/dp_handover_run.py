"""Disaggregated prefill (--dp-size 4, then --tp-size 4) -> decode (--dp-size 2) on 8 CPU
devices vs one single-device engine (run as a script).

Run by tests/engine/test_dp_handover.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. The prefill engine prefills each request on
one of its 4 ranks and exports that rank's KV pages and GDN states; the decode engine places
the request on the least-loaded of its 2 ranks and installs them there. The DP4 prefill engine
drafts with NEXTN, so its handovers also carry the rank's MTP KV pages and first drafts: a
plain DP2 decode engine ignores them, a NEXTN DP2 decode engine installs them on the rank the
request lands on; a one-device NEXTN engine hands over to that DP2 engine and takes over from
the DP4 one. Writes JSON: the outputs (ids and logprobs) every way, the engines' pool stats,
the handover programs' compile counts after warm-up and after serving, and the MTP drafts each
NEXTN decode side held at every proposal beside those of the one-device NEXTN engine serving
the same requests alone, and whether a weight update of the NEXTN DP2 engine swapped its MTP
params for the new checkpoint's.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import jax
import numpy as np

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=16, chunked_prefill_size=64, context_length=256, page_size=16,
            dtype="float32", random_seed=0, skip_warmup=True)
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)
NUM_REQUESTS, NUM_NEXTN_REQUESTS, MAX_NEW = 24, 48, 8


def requests(tag: str = "p", n: int = NUM_REQUESTS, seed: int = 1) -> list[GenerateReqInput]:
    """Greedy requests of 5 to 200 tokens (1 to 13 pages, up to 4 GDN chunks of 64), rids
    ``tag`` + index."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(5, 200))]
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        if i % 5 == 1:
            sp.update(frequency_penalty=0.5, repetition_penalty=1.3)
        out.append(GenerateReqInput(rid=f"{tag}{i}", input_ids=ids, sampling_params=sp,
                                    return_logprob=True))
    return out


def nextn_requests(tag: str) -> list[GenerateReqInput]:
    return requests(tag, NUM_NEXTN_REQUESTS, seed=2)


class DraftRecorder:
    """Wraps an engine's drafter: the MTP drafts each request holds at every proposal, by
    rid tag (its first letter), then "index/sequence length"."""

    def __init__(self, engine):
        self.inner, self.seen = engine.scheduler.drafter, {}
        engine.scheduler.drafter = self

    def propose(self, reqs, k):
        for r in reqs:
            self.seen.setdefault(r.rid[0], {})[f"{r.rid[1:]}/{r.num_fill}"] = list(r.draft_state)
        return self.inner.propose(reqs, k)


def summary(out: dict) -> dict:
    meta = out["meta_info"]
    return {"ids": out["output_ids"], "finish": meta["finish_reason"],
            "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
            "verify_ct": meta.get("spec_verify_ct", 0)}


def serve_one_engine(engine, objs: list[GenerateReqInput]) -> list[dict]:
    async def one(obj):
        return [o async for o in engine.generate_request(obj)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in objs))

    return [summary(o) for o in asyncio.run(run_all())]


def serve_disaggregated(prefill, decode, objs: list[GenerateReqInput]) -> list[dict]:
    async def one(obj):
        first, h = await prefill.prefill_for_handover(obj)
        if h is None:
            return first
        return [o async for o in decode.generate_from_handover(h)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in objs))

    return [summary(o) for o in asyncio.run(run_all())]


def program_counts(prefill, decode) -> list[int]:
    return [prefill.runner.transfer.export_program._cache_size(),
            decode.runner.transfer.install_program._cache_size()]


def main(out_path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    result = {}
    prefill = Engine(ServerArgs(dp_size=4, ep_size=4, **NEXTN, **ARGS), role="prefill")
    decode = Engine(ServerArgs(dp_size=2, ep_size=2, **ARGS), role="decode")
    prefill.runner.warm_up_state_transfer(gather=True, scatter=False)
    decode.runner.warm_up_state_transfer(gather=False, scatter=True)
    result["programs_after_warmup"] = program_counts(prefill, decode)
    result["pd_outputs"] = serve_disaggregated(prefill, decode, requests())
    result["programs_after_serving"] = program_counts(prefill, decode)
    serve_nextn(prefill, result, str(Path(out_path).parent))
    result["prefill_stats"] = prefill.pool_stats()
    prefill.shutdown()

    # Tensor-parallel prefill (heads split over 4 devices, the 2 kv heads and 2 GDN key heads
    # replicated twice) to the same DP2 decode engine: the state is converted to whole heads.
    tp = Engine(ServerArgs(tp_size=4, **ARGS), role="prefill")
    result["tp_outputs"] = serve_disaggregated(tp, decode, requests())
    result["tp_stats"] = tp.pool_stats()
    tp.shutdown()
    result["decode_stats"] = decode.pool_stats()
    decode.shutdown()

    single = Engine(ServerArgs(**ARGS))
    result["ref_outputs"] = serve_one_engine(single, requests())
    result["nextn_ref_outputs"] = serve_one_engine(single, nextn_requests("r"))
    single.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


def update_weights(engine, path: Path) -> dict:
    """Update ``engine`` to weights of another seed: the answer, and whether its placed MTP
    params then equal that checkpoint's ``mtp.*``."""
    from sglang_tpu_backend.model_loader.loader import load_mtp_params
    from sglang_tpu_backend.model_loader.tiny_model import write_random_model

    answer = engine.update_weights_from_disk(str(write_random_model(path, seed=1)))
    want = load_mtp_params(path, engine.model_config, dtype=np.float32)
    got = jax.device_get(engine.runner.nextn.params)
    same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), got, want))
    return {"success": answer["success"], "mtp_params_equal": all(same)}


def serve_nextn(prefill, result: dict, out_dir: str) -> None:
    """NEXTN handovers: the DP4 prefill engine -> a NEXTN DP2 decode engine (48 requests), a
    one-device NEXTN engine -> that DP2 engine and the DP4 engine -> the one-device engine
    (8 each); then the one-device engine serves the 48 requests alone. Records every NEXTN
    decode side's drafts (tags a, b, c) and the lone engine's (tag d)."""
    dp2 = Engine(ServerArgs(dp_size=2, ep_size=2, **NEXTN, **ARGS), role="decode")
    dp2.runner.warm_up_state_transfer(gather=False, scatter=True)  # (the MTP KV's too)
    one = Engine(ServerArgs(**NEXTN, **ARGS))
    one.runner.warm_up_state_transfer(gather=True, scatter=True)
    installs = [dp2.runner.transfer.mtp_install_program._cache_size()]
    dp2_drafts, one_drafts = DraftRecorder(dp2), DraftRecorder(one)
    result["nextn_dp_to_dp"] = serve_disaggregated(prefill, dp2, nextn_requests("a"))
    result["nextn_one_to_dp"] = serve_disaggregated(one, dp2, nextn_requests("b")[:8])
    result["nextn_dp_to_one"] = serve_disaggregated(prefill, one, nextn_requests("c")[:8])
    installs.append(dp2.runner.transfer.mtp_install_program._cache_size())
    result["nextn_mtp_install_programs"] = installs
    result["nextn_decode_stats"] = dp2.pool_stats()
    result["nextn_dp_weight_update"] = update_weights(dp2, Path(out_dir) / "seed1")
    dp2.shutdown()
    one.flush_cache()  # its drafts below from its own MTP KV only
    result["nextn_alone"] = serve_one_engine(one, nextn_requests("d"))
    result["nextn_drafts"] = {"dp2": dp2_drafts.seen, "one": one_drafts.seen}
    one.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
