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
from dp_ep_run import (LATE, LATE_STEP, PAGE, PAGES_PER_SEQ, PLAN, STEPS,  # noqa: E402
                       Request)

from sglang_tpu_backend.loader import load_model  # noqa: E402
from sglang_tpu_backend.model_executor.batch_builder import (SeqChunk,  # noqa: E402
                                                             build_forward_batch)
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode  # noqa: E402
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache  # noqa: E402
from sglang_tpu_backend.parallel import multihost as mh  # noqa: E402
from sglang_tpu_backend.parallel.dp_forward import DPForward  # noqa: E402
from sglang_tpu_backend.parallel.mesh import make_mesh  # noqa: E402
from sglang_tpu_backend.tiny_model import default_model_path  # noqa: E402


def init_dp_cache(dp):
    return dp.init_cache(num_pages=8 * PAGES_PER_SEQ, page_size=PAGE, num_state_slots=8,
                         kv_dtype=jnp.float32, state_dtype=jnp.float32)


def generate(dp, params, cache, cfg):
    """dp_ep_run.py's plan, scheduled by the leader, each step through the protocol
    (also in one process, where the broadcast is the identity). Returns the requests, done,
    and the requested mode of each step."""
    rng = np.random.default_rng(0)
    requests = []
    for rank, lens in PLAN.items():
        for slot, n in enumerate(lens):
            requests.append(Request(rank, slot, rng.integers(3, cfg.vocab_size, n).tolist()))
    late = Request(LATE[0], 0, rng.integers(3, cfg.vocab_size, LATE[1]).tolist())
    active, modes = list(requests), []
    for step in range(STEPS + 1):
        if step == LATE_STEP:
            active.append(late)
        live = [r for r in active if len(r.logits) <= STEPS - (LATE_STEP if r is late else 0)]
        per_rank = [[r for r in live if r.rank == k] for k in range(dp.dp_size)]
        decode = all(r.context > 0 for r in live)
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        T = max(8, max(sum(len(r.chunk().token_ids) for r in rs) for rs in per_rank))
        T = 1 << (T - 1).bit_length()
        R = 8
        T = R if decode else T
        batches, rows = [], []
        for rs in per_rank:
            fb, rws = build_forward_batch([r.chunk() for r in rs], page_size=PAGE, mode=mode,
                                          num_tokens=T, num_seqs=R, pages_per_seq=PAGES_PER_SEQ,
                                          num_logits=R)
            batches.append(fb)
            rows.append(rws)
        sent = mh.broadcast_step(batches, dp.dp_size)  # what every process runs
        for b, s in zip(batches, sent):  # the protocol round-trips the batch exactly
            assert s.mode == b.mode
            for name in mh._FIELDS:
                assert np.array_equal(getattr(s, name), getattr(b, name)), name
        logits, cache = mh.run_step(dp, params, cache, sent)
        modes.append(int(mode))
        logits = logits.reshape(dp.dp_size, R, -1)
        for k, rs in enumerate(per_rank):
            for r, rw in zip(rs, rows[k]):
                r.context += len(r.chunk().token_ids)
                r.logits.append(logits[k, rw[-1]])
                r.tokens.append(int(np.argmax(r.logits[-1])))
    mh.broadcast_step(None, dp.dp_size)  # stop the followers
    return active, modes


def alone(params, cfg, prompt, steps, prefill_bucket=64):
    """Greedy tokens and per-step logits of one request on one device (dp_ep_run.alone with
    the prompt padded to one bucket, so every request shares one prefill compile)."""
    cache = init_cache(cfg, num_pages=PAGES_PER_SEQ, page_size=PAGE, num_state_slots=1,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    pages = list(range(PAGES_PER_SEQ))
    batch, _ = build_forward_batch([SeqChunk(prompt, 0, pages, 0)], page_size=PAGE,
                                   num_tokens=prefill_bucket, num_seqs=1,
                                   pages_per_seq=PAGES_PER_SEQ, num_logits=1)
    logits, cache = forward_jit(params, cache, batch, cfg, "reference")
    out_logits, tokens = [np.asarray(logits[0])], []
    for step in range(steps):
        tokens.append(int(np.argmax(out_logits[-1])))
        batch, _ = build_forward_batch([SeqChunk([tokens[-1]], len(prompt) + step, pages, 0)],
                                       page_size=PAGE, pages_per_seq=PAGES_PER_SEQ)
        logits, cache = forward_jit(params, cache, batch, cfg, "reference")
        out_logits.append(np.asarray(logits[0]))
    return tokens, np.stack(out_logits)


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

    active, modes = generate(dp, params, cache, cfg)
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
