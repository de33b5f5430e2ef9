"""Host overhead of the engine per decode step at 64 running requests on the tiny model.

Measures, in one run and on the same shapes, each the median over N decode steps: the wall
time of a full engine step done one at a time (schedule + host array building + forward +
sample + result processing/detokenisation), the same steps overlapped as the serving loop runs
them (step i+1 launched before step i is completed), and the pure jitted forward alone; prints
the ratios to the forward.

    JAX_PLATFORMS=cpu python benchmarks/bench_host_overhead.py --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.server_args import ServerArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    n = args.num_requests
    eng = Engine(ServerArgs(model_path=args.model_path, max_running_requests=n, chunked_prefill_size=max(256, n),
                            context_length=512, dtype=args.dtype, skip_warmup=True), start_loop=False)
    budget = args.steps * 3 + 16  # prefill, warm steps, both timed loops, the forward-only batch
    for i in range(n):
        ids = [3 + (i * 31 + j * 7) % 1000 for j in range(args.prompt_len)]
        eng.add_request(GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": budget, "temperature": 0, "ignore_eos": True}))
    # Prefill everything, then run decode steps until steady state (compiles included here).
    while True:
        batch = eng.step()
        if batch.kind == ForwardMode.DECODE and len(batch.chunks) == n:
            break
    for _ in range(3):
        eng.step()
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = eng.step()
        step_times.append(time.perf_counter() - t0)
        assert batch.kind == ForwardMode.DECODE and len(batch.chunks) == n
    # Overlapped, as Engine._loop runs them: launch i+1, then complete i.
    overlap_times = []
    launched = eng._launch()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        nxt = eng._launch()
        eng._complete(launched)
        launched = nxt
        overlap_times.append(time.perf_counter() - t0)
        assert nxt.batch.kind == ForwardMode.DECODE and len(nxt.batch.chunks) == n
    eng._complete(launched)
    # Pure forward on the same shapes (same bucket, a real decode batch of this step).
    fb, _, _, _, _ = eng.runner.prepare(eng.scheduler.schedule())
    fwd_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(eng.runner.forward(fb))
        fwd_times.append(time.perf_counter() - t0)
    step, fwd = statistics.median(step_times), statistics.median(fwd_times)
    over = statistics.median(overlap_times)
    print(f"backend={jax.default_backend()} running={n} steps={args.steps}")
    print(f"engine decode step, one at a time: median {step * 1e3:.2f} ms")
    print(f"engine decode step, overlapped:    median {over * 1e3:.2f} ms")
    print(f"pure jitted forward:               median {fwd * 1e3:.2f} ms")
    print(f"host overhead one at a time: step / forward = {step / fwd:.3f}  (+{(step - fwd) * 1e3:.2f} ms)")
    print(f"host overhead overlapped:    step / forward = {over / fwd:.3f}  (+{(over - fwd) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
