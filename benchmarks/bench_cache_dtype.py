"""A bf16 model's step with its caches stored in bf16 against f32 (what the engine keeps on CPU).

XLA:CPU has no bf16 scatter: every KV write and GDN conv-state store into a bf16 cache
converts the whole cache to f32 and back. The engine therefore stores a 16-bit model's KV
pages and conv states in f32 on a CPU (``config.cache_storage_dtype``). This times the
jitted forward of the embedded default in bf16 with both cache dtypes, in turns, on a decode
step of ``--num-requests`` requests at ``--context`` tokens and on a prefill step of 4 prompts
of 64 tokens, and prints the ratios.

    JAX_PLATFORMS=cpu python benchmarks/bench_cache_dtype.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=50)
    ap.add_argument("--num-pages", type=int, default=4096, help="KV pool pages (the cache's size)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    cfg, params = load_model(default_model_path(), dtype=jnp.bfloat16)
    R, per_req = args.num_requests, -(-(args.context + 1) // PAGE)
    pages = lambda r: list(range(r * per_req, (r + 1) * per_req))  # noqa: E731
    decode, _ = build_forward_batch(
        [SeqChunk([5], args.context, pages(r), r) for r in range(R)], page_size=PAGE,
        num_tokens=R, num_seqs=R, pages_per_seq=per_req, num_logits=R)
    prefill, _ = build_forward_batch(
        [SeqChunk(list(range(3, 67)), 0, pages(r), r) for r in range(4)], page_size=PAGE,
        num_tokens=256, num_seqs=R, pages_per_seq=per_req, num_logits=R)
    caches = {d: init_cache(cfg, num_pages=args.num_pages, page_size=PAGE, num_state_slots=R,
                            kv_dtype=d) for d in (jnp.bfloat16, jnp.float32)}

    def step(dtype, batch) -> float:
        t0 = time.perf_counter()
        logits, caches[dtype] = forward_jit(params, caches[dtype], batch, cfg, impl="auto")
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    for name, batch in (("decode", decode), ("prefill", prefill)):
        times = {d: [] for d in caches}
        for d in caches:
            step(d, batch)  # compile
        for _ in range(args.steps):
            for d in caches:  # in turns: machine noise hits both alike
                times[d].append(step(d, batch))
        bf16, f32 = (statistics.median(times[d]) * 1e3 for d in (jnp.bfloat16, jnp.float32))
        print(f"{name:8s} bf16 cache {bf16:8.1f} ms   f32 cache {f32:8.1f} ms   "
              f"bf16 / f32 = {bf16 / f32:.2f}x   (KV pool {args.num_pages} pages, "
              f"{np.dtype(jnp.bfloat16).itemsize * caches[jnp.bfloat16].kv_pages.size >> 20} MiB in bf16)")


if __name__ == "__main__":
    main()
