"""The RL surface on --dp-size 2 --ep-size 2 and --tp-size 4 (4 simulated CPU devices; run
as a script).

Run by tests/engine/test_rl_surface.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4. An engine on checkpoint B gives the
reference; an engine on the tiny model's weights then takes B's tensors in two calls
(experts split over the devices: each placed with the serving leaf's sharding), is released
and resumed. Then an EPLB engine at --dp-size 2, rebalanced onto another placement, takes
B's tensors; then the same refit on a --tp-size 4 NEXTN engine (params re-laid out per head,
``TPForward.tp_params``; MTP params too) against a TP4 NEXTN engine started on B. Writes
JSON: the outputs, the programs lowered after the first outputs, the bytes freed and the
engine's device bytes before, whether shardings were kept and the MTP params equal.
"""

from __future__ import annotations

import asyncio
import json
import sys

import jax
import numpy as np

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
from sglang_tpu_backend.model_loader.tiny_model import write_random_model
from sglang_tpu_backend.server_args import ServerArgs

ARGS = dict(max_running_requests=8, chunked_prefill_size=32, context_length=128, page_size=16,
            dtype="float32", random_seed=0, dp_size=2, skip_warmup=True)
PROMPTS = ["Count with me: 1 2 3 4 5", "The capital of France is"]


def serve(engine: Engine) -> list[list[int]]:
    async def one(p):
        obj = GenerateReqInput(text=p, sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                        "ignore_eos": True})
        return [o async for o in engine.generate_request(obj)][-1]["output_ids"]

    async def run():
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
    engine.flush_cache()
    return asyncio.run(run())


def main(out_path: str, ckpt_dir: str) -> None:
    b = write_random_model(ckpt_dir, seed=1)
    ref = Engine(ServerArgs(model_path=str(b), **ARGS))
    result = {"b": serve(ref)}
    ref.shutdown()
    del ref
    eng = Engine(ServerArgs(**ARGS))
    result["a"] = serve(eng)
    counter = CompileCounter()
    tensors = read_checkpoint(b)
    names = sorted(tensors)
    before = jax.tree.leaves(eng.runner.params)
    for half in (names[::2], names[1::2]):
        res = eng.update_weights_from_tensor({n: tensors[n] for n in half})
        assert res["success"], res
    after = jax.tree.leaves(eng.runner.params)
    result["same_shardings"] = len(before) == len(after) and all(
        x.sharding == y.sharding for x, y in zip(before, after))
    result["refit"] = serve(eng)
    experts = eng.runner.params["layer_groups"][0]["mlp"]["experts"]["gate_up"]
    result["experts_split"] = len(experts.sharding.device_set) == 2 and not experts.sharding.is_fully_replicated
    result["device_bytes"] = sum(a.nbytes for a in jax.tree.leaves([eng.runner.params, eng.runner.cache]))
    result["freed_bytes"] = eng.release_memory_occupation()["freed_bytes"]
    eng.resume_memory_occupation()
    result["resumed"] = serve(eng)
    result["lowerings"] = counter.lowerings
    eng.shutdown()
    del eng

    # EPLB at --dp-size 2 (24 expert slots, 12 per EP rank), rebalanced onto another placement
    # first: B's tensors by their logical names land in every slot holding each expert.
    ep = Engine(ServerArgs(**ARGS, ep_num_redundant_experts=8, enable_eplb=True,
                           eplb_rebalance_num_iterations=10_000))
    runner, balancer = ep.runner, ep.runner.balancer
    start = balancer.location.logical.copy()
    balancer.window.add(np.random.default_rng(0).gamma(0.3, size=start.shape) * 100)
    runner.params = balancer.rebalance(runner.params)  # the loop is idle: no step runs
    result["eplb_moved"] = bool((balancer.location.logical != start).any())
    before = jax.tree.leaves(runner.params)
    res = ep.update_weights_from_tensor(tensors)
    assert res["success"], res
    after = jax.tree.leaves(runner.params)
    result["eplb_same_shardings"] = len(before) == len(after) and all(
        x.sharding == y.sharding for x, y in zip(before, after))
    result["eplb_refit"] = serve(ep)
    ep.shutdown()
    del ep

    # --tp-size 4 with NEXTN (kv heads and GDN key channels replicated over the devices): B's
    # tensors, mtp.* included, in two calls (the second merges into leaves the first built)
    # give a TP4 engine started on B's tokens and MTP params, every leaf placed as the one it
    # replaces; release / resume keep them.
    tp_args = {**ARGS, "dp_size": 1, "tp_size": 4, "speculative_algorithm": "NEXTN",
               "speculative_num_steps": 2}
    ref = Engine(ServerArgs(model_path=str(b), **tp_args))
    result["tp_b"] = serve(ref)
    want_mtp = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(ref.runner.nextn.params))]
    ref.shutdown()
    del ref
    tp = Engine(ServerArgs(**tp_args))
    result["tp"] = serve(tp)
    before = jax.tree.leaves(tp.runner.params)
    for half in (names[::2], names[1::2]):
        res = tp.update_weights_from_tensor({n: tensors[n] for n in half})
        assert res["success"], res
    after = jax.tree.leaves(tp.runner.params)
    result["tp_same_shardings"] = len(before) == len(after) and all(
        x.sharding == y.sharding for x, y in zip(before, after))
    got_mtp = jax.tree.leaves(jax.device_get(tp.runner.nextn.params))
    result["tp_mtp_equal"] = len(got_mtp) == len(want_mtp) and all(
        np.array_equal(np.asarray(x), y) for x, y in zip(got_mtp, want_mtp))
    result["tp_refit"] = serve(tp)
    tp.release_memory_occupation()
    tp.resume_memory_occupation()
    result["tp_resumed"] = serve(tp)
    tp.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
