"""DP x EP generation by several processes forming one mesh (run as a script, one per process).

    multihost_run.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npz
    multihost_run.py --single OUT.npz   # one process, 8 devices, plus every request alone

Started by tests/parallel/test_multihost.py: 2 processes, each with
XLA_FLAGS=--xla_force_host_platform_device_count=4, so the global mesh has 8 CPU devices
(4 chips x 2 dies, chips 0-1 in process 0, chips 2-3 in process 1). The plan is
tests/parallel/dp_ep_run.py's (uneven ranks, a late request turning steps MIXED). Process 0
leads: it schedules every step, broadcasts the rank batches, samples greedily from the
gathered logits and writes tokens + logits to OUT.npz; the other processes follow until the
leader sends stop. ``--single`` runs the same plan through the same helpers in ONE process
with 8 devices and also every request alone on one device (the references of the test).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Imports only: nothing below touches a JAX device before mh.initialize.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from dp_ep_run import alone, generate, init_dp_cache, make_requests  # noqa: E402

from sglang_tpu_backend.model_loader.loader import load_model  # noqa: E402
from sglang_tpu_backend.model_loader.tiny_model import default_model_path  # noqa: E402
from sglang_tpu_backend.parallel import multihost as mh  # noqa: E402
from sglang_tpu_backend.parallel.dp_forward import DPForward  # noqa: E402
from sglang_tpu_backend.parallel.mesh import make_mesh  # noqa: E402


def generate_through_protocol(dp, params, cache, cfg):
    """dp_ep_run.py's plan, scheduled by the leader, each step through the protocol (also in
    one process, where the broadcast is the identity). Returns the requests and step modes."""
    cache = [cache]

    def run_step(batches):
        sent = mh.broadcast_step(batches, dp.dp_size)  # what every process runs
        for b, s in zip(batches, sent):  # the protocol round-trips the batch exactly
            assert s.mode == b.mode
            for name in mh._FIELDS:
                assert np.array_equal(getattr(s, name), getattr(b, name)), name
        logits, cache[0] = mh.run_step(dp, params, cache[0], sent)
        return logits

    active, modes = generate(dp.dp_size, *make_requests(cfg), run_step)
    mh.broadcast_step(None, dp.dp_size)  # stop the followers
    return active, modes


def main(coordinator: str | None, num_processes: int, process_id: int, out_path: str) -> None:
    """``coordinator`` None: ONE process with 8 devices runs the same plan (through the same
    helpers) and also every request alone on one device."""
    if coordinator is not None:
        mh.initialize(coordinator, num_processes, process_id, cpu_collectives=True)

    t0 = time.perf_counter()
    assert len(jax.devices()) == 8, jax.devices()
    assert jax.process_count() == num_processes, (jax.process_count(), num_processes)
    cfg, host_params = load_model(default_model_path(), dtype=jnp.float32)
    dp = DPForward(cfg, make_mesh(8), impl="reference")
    params = dp.shard_params(host_params)
    cache = init_dp_cache(dp)

    if not mh.is_leader():
        cache, steps = mh.follower_loop(dp, params, cache)
        print(f"follower {process_id}: ran {steps} steps in {time.perf_counter() - t0:.1f}s",
              flush=True)
        mh.shutdown()
        return

    active, modes = generate_through_protocol(dp, params, cache, cfg)
    results = {}
    for i, r in enumerate(active):
        steps = len(r.logits) - 1
        results[f"dp_tokens_{i}"] = np.asarray(r.tokens[:steps])
        results[f"dp_logits_{i}"] = np.stack(r.logits)
    results["num_requests"] = np.asarray(len(active))
    results["step_modes"] = np.asarray(modes)
    results["process_count"] = np.asarray(jax.process_count())
    results["mesh_shape"] = np.asarray(dp.mesh.devices.shape)
    results["mesh_process"] = np.vectorize(lambda d: d.process_index)(dp.mesh.devices)
    results["seconds"] = np.asarray(time.perf_counter() - t0)
    if coordinator is None:
        for i, r in enumerate(active):
            tokens, logits = alone(host_params, cfg, r.prompt, len(r.logits) - 1)
            results[f"ref_tokens_{i}"] = np.asarray(tokens)
            results[f"ref_logits_{i}"] = logits
    np.savez(out_path, **results)
    print(f"leader: {len(active)} requests, {len(modes)} steps in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    if coordinator is not None:
        mh.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--single":
        main(None, 1, 0, sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
