"""An engine over 2 processes x 4 CPU devices vs one process with 8 (run as a script).

    multihost_engine_run.py --single OUT.json              # one process, 8 devices
    multihost_engine_run.py COORDINATOR NNODES RANK OUT.json [PAGE_SIZE]  # node RANK of an
                                                                          # --nnodes engine

Started by tests/engine/test_multihost_engine.py. Both engines are ``--dp-size 8 --ep-size 8``
with the same flags, prefix cache on; node 0 (and the single process) serves the same greedy
requests (different lengths, one longer than a prefill chunk, one with penalties), then two
of them again extended (prefix-cache hits), round-trips request state through the handover's
install and export on a rank of each node, and writes outputs and the weight bytes it read
as JSON; node 0 also tries a weight update (refused with --nnodes > 1) and then shuts
down, which stops the follower. A follower (rank > 0) runs ``parallel.node.run_follower`` and
writes the number of steps it ran and the weight bytes it read. ``PAGE_SIZE`` overrides that flag on this node (the
mismatch test: every node must then refuse to start).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(dp_size=8, ep_size=8, max_running_requests=16, chunked_prefill_size=32,
            context_length=128, page_size=16, dtype="float32", random_seed=0,
            skip_warmup=True, compilation_cache_dir="")
PROMPT_LENS = (3, 17, 70, 9, 40)  # 70 > chunked_prefill_size: a prompt in three chunks
REPEATS = (2, 4)  # prompts sent again, extended, after the first round: prefix-cache hits
TRANSFER_RANKS = (1, 6)  # a state transfer round trip on a rank of node 0 and one of node 1


def requests() -> list[GenerateReqInput]:
    out = []
    for i, n in enumerate(PROMPT_LENS):
        sp = {"max_new_tokens": 6 + i, "temperature": 0, "ignore_eos": True}
        if i == 3:
            sp.update(frequency_penalty=0.5, repetition_penalty=1.3)
        out.append(GenerateReqInput(input_ids=[(7 * i + 13 * k) % 997 + 3 for k in range(n)],
                                    sampling_params=sp))
    return out


def repeats() -> list[GenerateReqInput]:
    """The REPEATS prompts again with 20 more tokens: their cached prefix is reused."""
    out = []
    for i in REPEATS:
        ids = requests()[i].input_ids + [(5 * k) % 991 + 3 for k in range(20)]
        out.append(GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}))
    return out


def serve(engine, reqs: list[GenerateReqInput]) -> list[dict]:
    async def one(obj):
        return [o async for o in engine.generate_request(obj)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in reqs))

    return [{"output_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"]}
            for o in asyncio.run(run_all())]


def transfer_round_trip(runner) -> dict:
    """Install random request state into pages / a slot of each TRANSFER_RANKS rank, export it
    back, and report whether every array came back equal (on an idle engine)."""
    import types

    import numpy as np

    from sglang_tpu_backend.sampling.sampling_params import SamplingParams

    rng, req = np.random.default_rng(0), types.SimpleNamespace(sampling=SamplingParams())
    out = {}
    for rank in TRANSFER_RANKS:
        pages, slot = [5, 9, 2], runner.num_state_slots - 1
        state = [rng.standard_normal(a.shape).astype(a.dtype)
                 for a in runner.transfer.empty_state(runner.cache, len(pages))]
        runner.install_request_state(*state, pages, slot, req, rank)
        back = runner.export_request_state(pages, slot, rank)
        out[str(rank)] = all(np.array_equal(a, b) for a, b in zip(state, back))
    return out


def checkpoint_bytes(path: str) -> dict:
    """Tensor bytes of a checkpoint the engine loads (all but the MTP layer's ``mtp.*``, which
    only speculative decoding with NEXTN reads), and those of the routed experts."""
    from sglang_tpu_backend.model_loader.checkpoint_io import index_checkpoint

    entries = [e for e in index_checkpoint(path).values() if not e.name.startswith("mtp.")]
    return {"total": sum(e.end - e.begin for e in entries),
            "experts": sum(e.end - e.begin for e in entries if ".mlp.experts." in e.name)}


def main(argv: list[str]) -> None:
    t0 = time.perf_counter()
    if argv[0] == "--single":
        args, out_path = ServerArgs(**ARGS), argv[1]
    else:
        coord, nnodes, rank, out_path = argv[0], int(argv[1]), int(argv[2]), argv[3]
        flags = dict(ARGS, page_size=int(argv[4])) if len(argv) > 4 else ARGS
        args = ServerArgs(**flags, nnodes=nnodes, node_rank=rank, dist_init_addr=coord)
    if args.node_rank > 0:
        from sglang_tpu_backend.parallel.node import run_follower

        from sglang_tpu_backend.model_loader.checkpoint_io import BYTES_READ

        steps = run_follower(args)
        result = {"steps": steps, "bytes_read": BYTES_READ.bytes}
    else:
        import jax

        from sglang_tpu_backend.engine import Engine

        engine = Engine(args)
        try:
            first = serve(engine, requests())
            result = {"outputs": [o["output_ids"] for o in first],
                      "repeats": serve(engine, repeats()),
                      "transfer_round_trip": transfer_round_trip(engine.runner),
                      "num_steps": engine.stats["num_steps"],
                      "process_count": jax.process_count(),
                      "local_devices": len(jax.local_devices()),
                      "weight_update": engine.update_weights_from_disk(engine.args.model_path),
                      "stats": {k: v for k, v in engine.pool_stats().items() if k != "dp_ranks"},
                      "router_stats_shape": list(engine.runner.last_router_stats.shape),
                      "bytes_read": engine.runner.load_report.bytes_read,
                      "expert_ranges": sorted(engine.runner.load_report.expert_ranges.values()),
                      "checkpoint": checkpoint_bytes(engine.args.model_path)}
        finally:
            engine.shutdown()
    result["seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(f"done in {result['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
