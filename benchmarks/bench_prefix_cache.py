"""Time to first token of a repeated long prompt, with and without the prefix cache.

Two engines of the same shapes in one run: one with the radix cache, one with
``--disable-radix-cache``. Each first serves the prompt once (warm-up: compiles, and fills
the cache of the first engine), then serves the same prompt ``--repeats`` more times one
after the other; the time to first token is the median over those repeats. Prints both and
their ratio, and the prompt tokens the cached engine reused.

    JAX_PLATFORMS=cpu python benchmarks/bench_prefix_cache.py --prompt-len 1000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs


async def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first streamed token, and the cached prompt tokens."""
    obj = GenerateReqInput(input_ids=ids, stream=True,
                           sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    t0 = time.perf_counter()
    async for out in engine.generate_request(obj):
        return time.perf_counter() - t0, out["meta_info"]["cached_tokens"]
    raise RuntimeError("no output")


def measure(engine: Engine, ids: list[int], repeats: int) -> tuple[float, int]:
    asyncio.run(ttft(engine, ids))  # warm-up: compiles; fills the cache
    runs = [asyncio.run(ttft(engine, ids)) for _ in range(repeats)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    common = dict(model_path=args.model_path, max_running_requests=8, page_size=args.page_size,
                  chunked_prefill_size=args.chunked_prefill_size, dtype=args.dtype,
                  context_length=max(2048, args.prompt_len + 64), skip_warmup=True)
    rng = random.Random(0)
    ids = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
    results = {}
    for name, extra in (("radix cache", {}), ("no cache", {"disable_radix_cache": True})):
        engine = Engine(ServerArgs(**common, **extra))
        try:
            results[name] = measure(engine, ids, args.repeats)
        finally:
            engine.shutdown()
    (t_on, cached), (t_off, _) = results["radix cache"], results["no cache"]
    print(f"prompt {args.prompt_len} tokens, chunked prefill {args.chunked_prefill_size}, "
          f"median of {args.repeats} repeats")
    print(f"  TTFT with radix cache:    {t_on * 1e3:8.1f} ms  (cached_tokens {cached})")
    print(f"  TTFT without cache:       {t_off * 1e3:8.1f} ms")
    print(f"  speed-up (without / with): {t_off / t_on:6.2f}x")


if __name__ == "__main__":
    main()
