"""Engines with --dp-size 8 --ep-size 8 and with --tp-size 4 on 8 CPU devices vs --dp-size 1
(run as a script).

Run by tests/engine/test_dp_engine.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (fixed before jax starts). Both engines
serve the same 24 concurrent greedy requests of varied prompt lengths (some with penalties,
whose state is indexed by global slot); writes JSON: outputs of both, the DP runner's step
shapes and warm-up shapes, and the final pool stats. Then the DP and TP engines update their
weights to another checkpoint and back (``update_weights``): the outputs on each, and the
programs lowered while the warmed-up DP engine serves the new weights.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.model_loader.checkpoint_io import index_checkpoint, quantize_checkpoint_fp8
from sglang_tpu_backend.model_loader.tiny_model import default_model_path, write_random_model
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=32, chunked_prefill_size=32, context_length=128, page_size=16,
            dtype="float32", random_seed=0)
NUM_REQUESTS, MAX_NEW = 24, 8


def requests() -> list[GenerateReqInput]:
    rng = random.Random(0)
    out = []
    for i in range(NUM_REQUESTS):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))]
        sp = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        if i % 6 == 1:
            sp.update(frequency_penalty=0.5, repetition_penalty=1.3)
        out.append(GenerateReqInput(input_ids=ids, sampling_params=sp))
    return out


def wait_idle(engine, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = engine.pool_stats()
        if s["num_running"] == 0 and s["kv_pages_used"] == 0 or time.monotonic() > deadline:
            return s


def serve(engine) -> list[list[int]]:
    async def one(obj):
        return [o async for o in engine.generate_request(obj)][-1]

    async def run_all():
        return await asyncio.gather(*(one(o) for o in requests()))

    return [o["output_ids"] for o in asyncio.run(run_all())]


def fp8_experts_per_expert(config: dict, tensors: dict) -> None:
    """``write_random_model`` edit: the shipped 397B format (per-expert FP8 block-scaled)."""
    fp8 = quantize_checkpoint_fp8(tensors)
    tensors.clear()
    tensors.update(fp8)


def checkpoint_bytes(path: Path) -> dict:
    """Tensor bytes of a checkpoint the engine loads (all but the MTP layer's ``mtp.*``, which
    only speculative decoding with NEXTN reads), and those of the routed experts."""
    entries = [e for e in index_checkpoint(path).values() if not e.name.startswith("mtp.")]
    return {"total": sum(e.end - e.begin for e in entries),
            "experts": sum(e.end - e.begin for e in entries if ".mlp.experts." in e.name)}


def sharded_load(other: Path) -> dict:
    """A --dp-size 4 engine reading ``other`` shard by shard: its outputs and what it read."""
    engine = Engine(ServerArgs(dp_size=4, ep_size=4, skip_warmup=True, model_path=str(other),
                               **ARGS))
    report = engine.runner.load_report
    out = {"outputs": serve(engine), "bytes_read": report.bytes_read,
           "expert_bytes": list(report.expert_bytes.values()),
           "expert_ranges": sorted(report.expert_ranges.values()), **checkpoint_bytes(other)}
    engine.shutdown()
    return out


def dummy_weights() -> dict:
    """A --load-format dummy engine: outputs, and whether its weights are the seed's."""
    from sglang_tpu_backend.model_loader.sharded_loader import dummy_params

    engine = Engine(ServerArgs(skip_warmup=True, load_format="dummy", **ARGS))
    runner = engine.runner
    again = dummy_params(engine.model_config, jax.tree.map(lambda x: x.sharding, runner.params),
                         dtype=jax.numpy.float32, seed=ARGS["random_seed"])
    same = jax.tree.map(lambda a, b: bool((a == b).all()), runner.params, again)
    out = {"outputs": serve(engine), "bytes_read": runner.load_report.bytes_read,
           "params_reproduced": all(jax.tree.leaves(same))}
    engine.shutdown()
    return out


def update_weights(engine, other: Path) -> dict:
    """Serve on ``other``'s weights, then on the startup weights again."""
    res = engine.update_weights_from_disk(str(other))
    assert res["success"], res
    counter = CompileCounter()
    new_outputs = serve(engine)
    lowerings = counter.lowerings
    res = engine.update_weights_from_disk(str(default_model_path()))
    assert res["success"], res
    return {"new_outputs": new_outputs, "new_lowerings": lowerings, "old_outputs": serve(engine),
            "stats": wait_idle(engine)}


def main(out_path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    result = {}
    other = write_random_model(Path(tempfile.mkdtemp()) / "seed1", seed=1,
                               edit=fp8_experts_per_expert)
    dp = Engine(ServerArgs(dp_size=8, ep_size=8, **ARGS))  # warms up the DP step shapes
    seen = []
    real_forward = dp.runner.forward

    def recording_forward(fbs, from_slot=None):
        fb = fbs[0]
        seen.append((fb.mode.name, fb.input_ids.shape[0], fb.kv_lens.shape[0],
                     fb.logits_indices.shape[0]))
        return real_forward(fbs, from_slot)

    dp.runner.forward = recording_forward
    t0 = time.perf_counter()
    result["dp_outputs"] = serve(dp)
    result["dp_serve_seconds"] = time.perf_counter() - t0
    result["dp_stats"] = wait_idle(dp)
    result["dp_server_info_keys"] = sorted(dp.get_server_info())
    result["dp_step_shapes"] = sorted(set(seen))
    result["dp_warm_shapes"] = [(m.name, T, R, L) for m, T, R, L in dp.runner.all_shapes()]
    result["dp_warmup_seconds"] = dp.warmup_seconds
    result["dp_update"] = update_weights(dp, other)
    dp.shutdown()

    tp = Engine(ServerArgs(tp_size=4, skip_warmup=True, **ARGS))  # tensor-parallel attention
    result["tp_outputs"] = serve(tp)
    result["tp_stats"] = wait_idle(tp)
    result["tp_update"] = update_weights(tp, other)
    tp.shutdown()

    single = Engine(ServerArgs(skip_warmup=True, **ARGS))
    result["ref_outputs"] = serve(single)
    result["ref_stats"] = wait_idle(single)
    single.shutdown()
    result["dp4_sharded"] = sharded_load(other)
    result["dummy"] = dummy_weights()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
