"""Chunk size of the GDN chunked path on this CPU: one prefill-heavy model step, side by side.

The embedded default's shapes in fp32, one MIXED step of 256 tokens (4 prompts x 64 fresh
tokens, the layout of ``bench_vs_transformers.py``'s prefill steps), compiled once per GDN
chunk size and timed in one run (best and median of ``--iters`` calls). Prints each step
time and its ratio to the 64-token chunk (the Pallas kernels' chunk); ``kernels/gdn.py``'s
``XLA_CHUNK_SIZE`` comes from this.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_gdn_chunk.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import numpy as np

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.kernels import gdn
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.forward_batch import dummy_batch
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.server_args import ServerArgs


def mixed_batch(runner, prompts: int = 4, length: int = 64, T: int = 256, R: int = 32):
    fb = dummy_batch(ForwardMode.MIXED, T, R, R, runner.pages_per_seq)
    fb.num_seqs[:] = prompts
    fb.kv_lens[:prompts] = length
    fb.cu_q_lens[: prompts + 1] = np.arange(prompts + 1) * length
    fb.cu_q_lens[prompts + 1:] = prompts * length
    fb.positions[:] = np.arange(T) % length
    pages = runner.cache.kv_pages.shape[1]
    fb.page_table[:] = (np.arange(fb.page_table.shape[1])[None] + 8 * np.arange(R)[:, None]) % pages
    return fb


def step_seconds(runner, fb, chunk: int, iters: int) -> list[float]:
    jax.clear_caches()
    step = jax.jit(functools.partial(qwen3_5_moe.forward, cfg=runner.cfg, impl="xla",
                                     with_stats=False), donate_argnames=("cache",))
    original = gdn.gated_delta_net
    gdn.gated_delta_net = functools.partial(original, chunk_size=chunk)
    try:
        compiled = step.lower(runner.params, runner.cache, fb).compile()
    finally:
        gdn.gated_delta_net = original
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        logits, runner.cache = compiled(runner.params, runner.cache, fb)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="64,32,16")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    eng = Engine(ServerArgs(dtype="float32", max_running_requests=32, context_length=256,
                            chunked_prefill_size=256, skip_warmup=True, compilation_cache_dir=""),
                 start_loop=False)
    fb = mixed_batch(eng.runner)
    rows = {c: step_seconds(eng.runner, fb, c, args.iters) for c in map(int, args.chunks.split(","))}
    base = min(rows[64]) if 64 in rows else None
    print("tiny default fp32, one MIXED step of 256 tokens (4 x 64-token prompts)")
    for chunk, t in rows.items():
        ratio = f"  {min(t) / base:.2f}x of chunk 64" if base else ""
        print(f"GDN chunk {chunk:3d}: best {min(t) * 1e3:7.1f} ms, median "
              f"{statistics.median(t) * 1e3:7.1f} ms{ratio}")
    eng.shutdown()


if __name__ == "__main__":
    main()
