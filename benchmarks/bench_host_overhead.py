"""Host overhead of the engine per decode step at 64 running requests on the tiny model.

Measures, in one run and on the same shapes, the wall time of a full engine decode step done
one at a time (schedule + host array building + forward + sample + result
processing/detokenisation), the same steps overlapped as the serving loop runs them (step i+1
launched before step i is completed), and the pure jitted forward alone, taking turns in
rounds; prints the ratios to the forward (median over the rounds).

    JAX_PLATFORMS=cpu python benchmarks/bench_host_overhead.py --steps 30

With ``--speculative-num-draft-tokens N`` (N = k+1) the engine runs NGRAM's verify steps
instead (every request drafting k tokens, the target rejecting them), which the loop cannot
overlap (the next step's drafts come from the tokens this one accepts): it compares the
engine's verify step, one at a time, with the device programs of the same step alone
(verify forward + verify sampler + commit). Their difference is the host's share of a
verify step, what overlapping could hide at most.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_executor.sampler_state import sampler_variant
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.drafter import CallbackDrafter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    ap.add_argument("--rounds", type=int, default=6, help="the kinds take turns this many times")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=0)
    args = ap.parse_args()
    n = args.num_requests
    spec = ({"speculative_algorithm": "NGRAM",
             "speculative_num_draft_tokens": args.speculative_num_draft_tokens}
            if args.speculative_num_draft_tokens else {})
    eng = Engine(ServerArgs(model_path=args.model_path, max_running_requests=n, chunked_prefill_size=max(256, n),
                            context_length=512, dtype=args.dtype, skip_warmup=True, **spec),
                 start_loop=False)
    if spec:
        eng.scheduler.drafter = CallbackDrafter(lambda req, k: [7] * k)
        return verify_overhead(eng, n, args)
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
    # The three kinds run in turns, a few steps each round, so the machine's drift (it is
    # shared) hits them alike; each ratio is the median of the rounds' ratios.
    per_round = max(1, args.steps // args.rounds)
    step_times, overlap_times, fwd_times, ratios = [], [], [], {"step": [], "overlap": []}
    for _ in range(args.rounds):
        t_step, t_over, t_fwd = [], [], []
        for _ in range(per_round):  # one at a time: schedule, build, forward, sample, process
            t0 = time.perf_counter()
            batch = eng.step()
            t_step.append(time.perf_counter() - t0)
            assert batch.kind == ForwardMode.DECODE and len(batch.chunks) == n
        launched = eng.loop._launch()  # overlapped, as Engine._loop runs them: launch i+1, complete i
        for _ in range(per_round):
            t0 = time.perf_counter()
            nxt = eng.loop._launch()
            eng.loop._complete(launched)
            launched = nxt
            t_over.append(time.perf_counter() - t0)
            assert nxt.batch.kind == ForwardMode.DECODE and len(nxt.batch.chunks) == n
        eng.loop._complete(launched)
        # The pure forward on the last step's arrays (same bucket; it rewrites that step's KV
        # rows and advances GDN states, which only changes the tokens the timing ignores).
        fbs = eng.runner.prepare(launched.batch).fbs
        for _ in range(per_round):
            t0 = time.perf_counter()
            jax.block_until_ready(eng.runner.forward(fbs))
            t_fwd.append(time.perf_counter() - t0)
        fwd_round = statistics.median(t_fwd)
        ratios["step"].append(statistics.median(t_step) / fwd_round)
        ratios["overlap"].append(statistics.median(t_over) / fwd_round)
        step_times += t_step
        overlap_times += t_over
        fwd_times += t_fwd
    step, fwd = statistics.median(step_times), statistics.median(fwd_times)
    over = statistics.median(overlap_times)
    r_step, r_over = statistics.median(ratios["step"]), statistics.median(ratios["overlap"])
    print(f"backend={jax.default_backend()} running={n} steps={args.steps}")
    print(f"engine decode step, one at a time: median {step * 1e3:.2f} ms")
    print(f"engine decode step, overlapped:    median {over * 1e3:.2f} ms")
    print(f"pure jitted forward:               median {fwd * 1e3:.2f} ms")
    print(f"host overhead one at a time: step / forward = {r_step:.3f}  (+{(step - fwd) * 1e3:.2f} ms)")
    print(f"host overhead overlapped:    step / forward = {r_over:.3f}  (+{(over - fwd) * 1e3:.2f} ms)")
    print(f"  per-round overlapped ratios: {' '.join(f'{r:.3f}' for r in ratios['overlap'])}")


def verify_overhead(eng: Engine, n: int, args) -> None:
    """The host's share of a verify step (module docstring)."""
    for i in range(n):
        ids = [3 + (i * 31 + j * 7) % 1000 for j in range(args.prompt_len)]
        eng.add_request(GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": args.steps * 3 + 16, "temperature": 0, "ignore_eos": True}))
    while True:  # prefill, then verify steps until steady state (compiles included here)
        batch = eng.step()
        if batch.kind == ForwardMode.TARGET_VERIFY and len(batch.chunks) == n:
            break
    for _ in range(3):
        batch = eng.step()
    per_round = max(1, args.steps // args.rounds)
    step_times, dev_times, ratios = [], [], []
    for _ in range(args.rounds):
        t_step, t_dev = [], []
        for _ in range(per_round):
            t0 = time.perf_counter()
            batch = eng.step()
            t_step.append(time.perf_counter() - t0)
            assert batch.kind == ForwardMode.TARGET_VERIFY and len(batch.chunks) == n
        runner = eng.runner
        variant = sampler_variant(batch.chunks)
        step = runner.prepare(batch, variant)  # the last step's arrays (it rewrites that step's rows)
        for _ in range(per_round):
            t0 = time.perf_counter()
            jax.block_until_ready((runner.verify(step.fbs, step.spec, step.inp, step.K, variant),
                                   runner.cache))
            t_dev.append(time.perf_counter() - t0)
        ratios.append(statistics.median(t_step) / statistics.median(t_dev))
        step_times += t_step
        dev_times += t_dev
    step, dev = statistics.median(step_times), statistics.median(dev_times)
    print(f"backend={jax.default_backend()} running={n} verify steps, "
          f"k+1={args.speculative_num_draft_tokens} steps={args.steps}")
    print(f"engine verify step, one at a time:        median {step * 1e3:.2f} ms")
    print(f"its device programs alone (verify+commit): median {dev * 1e3:.2f} ms")
    print(f"host share: step / device = {statistics.median(ratios):.3f}  "
          f"(+{(step - dev) * 1e3:.2f} ms, {(step - dev) / step:.0%} of the step)")


if __name__ == "__main__":
    main()
