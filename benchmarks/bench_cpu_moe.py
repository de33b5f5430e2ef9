"""CPU cost of the MoE: the reference grouped matmuls vs the tiled XLA path, side by side.

Times, in one run on the same inputs (median wall time of jitted calls):
  1. one routed-experts layer (``models.moe.routed_experts``: routing metadata, row gather,
     grouped SwiGLU matmul, grouped down matmul, weighted reduce) at 64 decode rows, with
     ``impl="reference"`` and ``impl="xla"`` (the XLA path once per ``--tm`` tile size), on
       tiny: hidden 128, 16 experts top-4, expert width 64 (the embedded tiny model's MoE);
       mid:  hidden 1024, 64 experts top-8, expert width 512;
  2. the whole MoE block (router, routed experts, shared expert of width 128 tiny / 512 mid,
     Qwen3-Next's shared width equals its expert width) for the same inputs;
  3. the whole tiny-model decode step (``ModelRunner.forward``) on a 64-request decode batch
     with ``impl="reference"`` (before) and ``impl="auto"`` (after; the XLA path on CPU),
     alternating three rounds of each and reporting the median round.
Prints each time and the ratio reference / new.

    JAX_PLATFORMS=cpu python benchmarks/bench_cpu_moe.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.kernels import gmm_xla  # (XLA_TILE_ROWS: the XLA path's tile floor)
from sglang_tpu_backend.model_loader.tiny_model import tiny_config_dict
from sglang_tpu_backend.models.moe import routed_experts
from sglang_tpu_backend.models.qwen3_5_moe import moe_block, route_tokens

CONFIGS = {  # name: (hidden, experts, top-k, expert width, shared-expert width)
    "tiny": (128, 16, 4, 64, 128),
    "mid": (1024, 64, 8, 512, 512),
}


def median_seconds(fn, reps: int) -> float:
    """Median wall time of ``fn()`` (results waited for) over ``reps`` calls after one warm-up
    (the warm-up compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_params(h: int, e: int, i: int, s: int, dtype, seed: int = 0) -> dict:
    """Random MoE-block params in the model's layout (models/qwen3_5_moe.py): routed experts
    [E, out, in], the rest [in, out]."""
    rng = np.random.default_rng(seed)
    w = lambda fan_in, *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)  # noqa: E731
    return {"gate": w(h, h, e), "experts": {"gate_up": w(h, e, 2 * i, h), "down": w(i, e, h, i)},
            "shared_expert": {"gate_up": w(h, h, 2 * s), "down": w(s, s, h)},
            "shared_expert_gate": w(h, h, 1)}


def bench_layer(name: str, rows: int, tms: list[int], reps: int, dtype) -> None:
    h, e, k, i, s = CONFIGS[name]
    base = model_config_from_dict(tiny_config_dict(vocab_size=256, eos_token_id=1))
    cfg = dataclasses.replace(base, hidden_size=h, num_experts=e, num_experts_per_tok=k,
                              moe_intermediate_size=i, shared_expert_intermediate_size=s)
    p = moe_params(h, e, i, s, dtype)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, h)), dtype)
    top_w, top_i = route_tokens(x @ p["gate"], cfg, act_dtype=dtype)
    ex = p["experts"]
    print(f"== {name}: hidden {h}, {e} experts top-{k}, expert width {i}, shared {s}, "
          f"{rows} rows, {jnp.dtype(dtype).name}")
    for what, make in (
        ("routed_experts", lambda impl: jax.jit(
            lambda x, ti, tw: routed_experts(ex, x, ti, tw, e, 0, impl))),
        ("moe_block", lambda impl: jax.jit(lambda x, ti, tw: moe_block(p, x, cfg, impl))),
    ):
        ref = median_seconds(lambda f=make("reference"): f(x, top_i, top_w), reps)
        line = f"  {what:15s} reference {ref * 1e3:9.2f} ms"
        want = make("reference")(x, top_i, top_w)
        for tm in tms:
            gmm_xla.XLA_TILE_ROWS = tm
            f = make("xla")
            got = f(x, top_i, top_w)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            t = median_seconds(lambda: f(x, top_i, top_w), reps)
            line += f" | xla tm={tm} {t * 1e3:8.2f} ms ({ref / t:6.1f}x, max|diff| {err:.1e})"
        print(line)
    gmm_xla.XLA_TILE_ROWS = tms[0]


def bench_decode_step(num_requests: int, reps: int, dtype: str) -> None:
    """Tiny-model decode step (ModelRunner.forward) at ``num_requests`` with each impl."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
    from sglang_tpu_backend.server_args import ServerArgs

    n = num_requests
    eng = Engine(ServerArgs(max_running_requests=n, chunked_prefill_size=max(256, n),
                            context_length=512, dtype=dtype, skip_warmup=True,
                            kernel_impl="auto"), start_loop=False)
    for r in range(n):
        ids = [3 + (r * 31 + j * 7) % 1000 for j in range(16)]
        eng.add_request(GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}))
    while True:  # prefill everything until a full decode batch runs
        batch = eng.step()
        if batch.kind == ForwardMode.DECODE and len(batch.chunks) == n:
            break
    fbs = eng.runner.prepare(eng.scheduler.schedule()).fbs
    rounds = {"reference": [], "auto": []}
    for _ in range(3):  # alternate, so load changes on a shared machine hit both alike
        for impl in rounds:
            eng.runner.backend.impl = impl  # static under jit: a separate compilation per impl
            rounds[impl].append(median_seconds(lambda: eng.runner.forward(fbs), reps))
    times = {impl: statistics.median(ts) for impl, ts in rounds.items()}
    print(f"== tiny model decode step (ModelRunner.forward), {n} requests, {dtype}")
    print(f"  reference {times['reference'] * 1e3:9.2f} ms | auto {times['auto'] * 1e3:8.2f} ms "
          f"({times['reference'] / times['auto']:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64, help="decode rows (tokens)")
    ap.add_argument("--tm", type=int, nargs="+", default=[gmm_xla.XLA_TILE_ROWS],
                    help="XLA-path tile rows to time (the first is kept for the model step)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--no-model", action="store_true", help="skip the model decode step")
    args = ap.parse_args()
    print(f"backend={jax.default_backend()} devices={jax.device_count()}")
    for name in args.configs:
        bench_layer(name, args.rows, args.tm, args.reps if name == "tiny" else max(3, args.reps // 3),
                    jnp.bfloat16)
    if not args.no_model:
        bench_decode_step(args.rows, args.reps, "bfloat16")


if __name__ == "__main__":
    main()
