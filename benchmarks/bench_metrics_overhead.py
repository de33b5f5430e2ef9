"""Cost of the always-on metrics: the in-step router stats and the per-step host hooks.

Runs the tiny model's jitted forward for a decode step of ``--num-requests`` requests with and
without the router-stats reductions (same shapes, interleaved, median of ``--steps``), and
times ``EngineMetrics.on_step`` + ``on_router_stats`` for that batch size.

    JAX_PLATFORMS=cpu python benchmarks/bench_metrics_overhead.py --num-requests 64 --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.metrics import EngineMetrics
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_loader.loader import load_params
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    path = default_model_path()
    cfg = load_model_config(path)
    params = load_params(path, cfg, dtype=jnp.float32)
    R, ps = a.num_requests, 16
    ppr = -(-(a.context + 1) // ps)
    cache = init_cache(cfg, num_pages=R * ppr, page_size=ps, num_state_slots=R,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    chunks = [SeqChunk([5], a.context, list(range(r * ppr, (r + 1) * ppr)), r, "last") for r in range(R)]
    fb, _ = build_forward_batch(chunks, page_size=ps, mode=ForwardMode.DECODE)
    times = {False: [], True: []}
    for with_stats in (False, True):  # compile both
        out = forward_jit(params, cache, fb, cfg=cfg, impl="reference", with_stats=with_stats)
        cache = out[1]
        jax.block_until_ready(out[0])
    for _ in range(a.steps):
        for with_stats in (False, True):
            t = time.perf_counter()
            out = forward_jit(params, cache, fb, cfg=cfg, impl="reference", with_stats=with_stats)
            cache = out[1]
            jax.block_until_ready(out[0])
            if with_stats:
                np.asarray(out[2])  # the host fetch the runner does
            times[with_stats].append(time.perf_counter() - t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"decode step, {R} requests, tiny model ({cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts): forward {off * 1e3:.3f} ms without router stats, "
          f"{on * 1e3:.3f} ms with ({(on / off - 1) * 100:+.1f}%)")
    m = EngineMetrics("bench", dp_size=1, num_moe_layers=cfg.num_hidden_layers)
    reqs = [types.SimpleNamespace(admit_time=0.0, arrival_time=0.0, output_ids=[1], first_token_time=0.1,
                                  last_token_time=0.1) for _ in range(R)]
    batch = [types.SimpleNamespace(req=r) for r in reqs]
    stats = np.asarray(out[2]).reshape(1, -1, 3)
    t = time.perf_counter()
    for i in range(a.steps):
        for r in reqs:
            r.output_ids.append(1)
            r.last_token_time += 0.01
        m.on_step(batch, reqs)
        m.on_router_stats(stats)
    host = (time.perf_counter() - t) / a.steps
    t = time.perf_counter()
    m.render({})
    print(f"host metric hooks: {host * 1e6:.1f} us per step ({R} tokens); one scrape render "
          f"{(time.perf_counter() - t) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
