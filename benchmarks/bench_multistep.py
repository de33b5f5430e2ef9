"""Multi-step decoding side by side: tok/s and ms per token for --num-scheduler-steps 1, 4, 8.

    python benchmarks/bench_multistep.py [--dtype bfloat16] [--requests 1,16] [--steps 1,4,8]
                                         [--new-tokens 128] [--json out.json] [--model-path DIR]
                                         [--disable-overlap-schedule]

One engine per N (in this process, one after another; each warms up, so serving compiles
nothing), the embedded tiny model unless ``--model-path``. For each request count R: R prompts
of 16 tokens, ``--new-tokens`` greedy tokens each (ignore_eos), through the engine's own
scheduler loop (``OfflineEngine``, no sockets: runs on a TPU as on the CPU), twice; the
second run is measured. Reported per (N, R): output tok/s, ms per token of one request
(wall / new tokens; the fastest of ``--repeat`` runs), launches (scheduler loop steps) and their multi-step share, and the loop
thread's host time per launch by phase (``bench_engine.PhaseTimer``: schedule, build,
dispatch, wait+d2h, process, deliver) and per token.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax

from bench_engine import PhaseTimer, serve_once  # benchmarks/ is the script's path
from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.entrypoints.offline import OfflineEngine
from sglang_tpu_backend.model_executor import multistep
from sglang_tpu_backend.server_args import ServerArgs


def start(args: argparse.Namespace, num_steps: int, max_running: int) -> Engine:
    """The engine with every program compiled (a staged warm-up's second stage waited for)."""
    eng = Engine(ServerArgs(model_path=args.model_path, dtype=args.dtype,
                             max_running_requests=max_running, context_length=args.context_length,
                             chunked_prefill_size=args.chunked_prefill_size, random_seed=0,
                             num_scheduler_steps=num_steps, compilation_cache_dir="",
                             disable_overlap_schedule=args.disable_overlap_schedule,
                             skip_warmup=args.skip_warmup))
    if eng.background_warmup is not None:
        eng.background_warmup.wait()
    return eng


def measure(eng: Engine, n: int, new_tokens: int, repeat: int) -> dict[str, Any]:
    """``repeat`` measured runs of ``n`` requests x ``new_tokens`` (after an unmeasured one):
    the fastest (a shared host's noise only ever slows a run down), with every run's tok/s."""
    off = OfflineEngine(engine=eng)
    serve_once(off, n, new_tokens)
    runs = [measure_once(eng, off, n, new_tokens) for _ in range(repeat)]
    best = max(runs, key=lambda r: r["tok_per_s"])
    return dict(best, all_tok_per_s=[r["tok_per_s"] for r in runs])


def measure_once(eng: Engine, off: OfflineEngine, n: int, new_tokens: int) -> dict[str, Any]:
    """One timed run, the loop thread's phases timed."""
    runner, sched = eng.runner, eng.scheduler
    timer = PhaseTimer()
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(runner, "prepare", "build")
    for method in ("forward", "sample"):
        timer.wrap(runner, method, "dispatch")
    timer.wrap(multistep, "dispatch", "dispatch")  # the multi-step program's dispatch
    timer.wrap(runner, "complete", "wait+d2h")
    timer.wrap(sched, "process_result", "process")
    timer.wrap(eng.loop.delivery, "deliver", "deliver")
    steps0, multi0 = eng.loop.stats["num_steps"], sched.num_multistep_launches
    try:
        seconds = serve_once(off, n, new_tokens)
    finally:
        timer.restore()
    steps = eng.loop.stats["num_steps"] - steps0
    tokens = n * new_tokens
    per_launch = {k: v / steps * 1e3 for k, v in timer.totals.items()}
    host = sum(v for k, v in timer.totals.items() if k != "wait+d2h")
    return {"requests": n, "new_tokens": new_tokens, "seconds": seconds,
            "tok_per_s": tokens / seconds, "ms_per_token": seconds / new_tokens * 1e3,
            "launches": steps, "multistep_launches": sched.num_multistep_launches - multi0,
            "phase_ms_per_launch": per_launch, "host_ms_per_launch": host / steps * 1e3,
            "host_ms_per_token": host / tokens * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", default="1,16")
    ap.add_argument("--steps", default="1,4,8", help="--num-scheduler-steps values")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--chunked-prefill-size", type=int, default=1024)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--skip-warmup", action="store_true",
                    help="compile on first use (the unmeasured first run) instead")
    ap.add_argument("--repeat", type=int, default=3,
                    help="measured runs per case; the fastest is reported")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(x) for x in args.requests.split(",")]
    report: dict[str, Any] = {"dtype": args.dtype, "backend": jax.default_backend(),
                              "device_kind": jax.devices()[0].device_kind,
                              "overlap": not args.disable_overlap_schedule, "runs": []}
    print(f"backend {report['backend']} ({report['device_kind']}), {args.dtype}, "
          f"overlap {'off' if args.disable_overlap_schedule else 'on'}")
    for num_steps in (int(x) for x in args.steps.split(",")):
        eng = start(args, num_steps, max(counts))
        try:
            for n in counts:
                r = dict(measure(eng, n, args.new_tokens, args.repeat), num_scheduler_steps=num_steps)
                report["runs"].append(r)
                ph = "  ".join(f"{k} {v:.3f}" for k, v in r["phase_ms_per_launch"].items())
                print(f"N={num_steps:<2d} {n:4d} requests x {args.new_tokens}: "
                      f"{r['tok_per_s']:9.1f} tok/s, {r['ms_per_token']:7.3f} ms/token/request, "
                      f"{r['launches']} launches ({r['multistep_launches']} multi-step), host "
                      f"{r['host_ms_per_launch']:.3f} ms/launch = "
                      f"{r['host_ms_per_token']:.3f} ms/token")
                print(f"      per launch (ms): {ph}")
        finally:
            eng.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
