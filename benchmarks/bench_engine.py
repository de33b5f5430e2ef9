"""The engine end to end on whatever backend runs it: start-up, tok/s and where a step's time goes.

    python benchmarks/bench_engine.py [--dtype bfloat16] [--requests 1,64] [--new-tokens 128]
                                      [--num-scheduler-steps N] [--json out.json]
                                      [--model-path DIR]

In one process, in this order:

  start-up  in a child process (a chip takes one process at a time, so before this one
            opens it): imports and ``Engine(...)`` to ready by phase (the backend opened on a
            thread while the tokenizer loads; weights loaded; every serving program compiled
            by the warm-up, or a staged warm-up's first stage) with an empty persistent
            compilation cache (a fresh temp dir); then a second child with that cache filled.
            Each lists JAX's tracing, lowering and backend-compile seconds by function (summed
            over the warm-up's threads, so they may add up to more than the wall time).
  serving   for each request count N: N prompts of 16 tokens, ``--new-tokens`` greedy tokens
            each (ignore_eos), through the running engine (its scheduler loop, overlap on where
            the engine turns it on), three times; output tok/s of the second (the first may
            still meet a first-run cost; the third runs under the profiler, which slows the
            host, and gives the device's busy time only).
  split     during that second run, the loop thread's time per decode step by phase, from
            timers around the engine's own methods: ``schedule`` (scheduler), ``build``
            (numpy step inputs), ``dispatch`` (enqueueing the forward and sampler programs,
            host to device copies of the inputs included), ``wait+d2h`` (``complete``: blocked
            on the device, then the one device-to-host copy of the step's outputs),
            ``process`` and ``deliver``; and from a ``jax.profiler`` trace of the third run the
            device's busy time per step (the union of its XLA module executions) and the
            ops that fill it (device ms per step by op name), and the device-to-host copy of
            one step's outputs alone (``d2h``, a ready array fetched).

With ``--num-scheduler-steps N`` > 1 a "step" is a launch: a multi-step decode launch runs N
tokens per request in one program (``dispatch`` then times that program's dispatch).

A step's wall time is the loop's time between steps; where the host sets the pace, the device
is idle part of it (``device busy`` < step). Printed as a table; ``--json`` writes every figure.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()  # before the imports: a start-up child counts them

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Callable

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sglang_tpu_backend.engine import Engine  # noqa: E402
from sglang_tpu_backend.model_executor import multistep  # noqa: E402
from sglang_tpu_backend.entrypoints.offline import OfflineEngine  # noqa: E402
from sglang_tpu_backend.server_args import ServerArgs  # noqa: E402

PROMPT_LEN = 16
TOP_N = 12  # functions listed
TOP_OPS = 24  # device ops listed


def make_engine(args: argparse.Namespace, cache_dir: str, max_running: int) -> Engine:
    """The engine, returned once ready (a staged warm-up may still compile in the background)."""
    return Engine(ServerArgs(model_path=args.model_path, dtype=args.dtype,
                             max_running_requests=max_running, context_length=args.context_length,
                             chunked_prefill_size=args.chunked_prefill_size,
                             compilation_cache_dir=cache_dir, random_seed=0,
                             num_scheduler_steps=args.num_scheduler_steps,
                             page_size=args.page_size,
                             warmup_in_background=args.warmup_in_background))


def start(args: argparse.Namespace, cache_dir: str, max_running: int) -> Engine:
    """The engine with every program compiled (a staged warm-up's second stage waited for)."""
    eng = make_engine(args, cache_dir, max_running)
    if eng.background_warmup is not None:
        eng.background_warmup.wait()
    return eng


def startup_child(args: argparse.Namespace) -> None:
    """The start-up figures of this process (a child of ``main``), as one JSON line."""
    t_imports = time.perf_counter() - T_PROCESS
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    compile_s: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)

    per_fun: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    timeline: list[tuple[float, str, float]] = []  # (end s, function, compile s) per program

    def on_duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
        if event.startswith("/jax/core/compile/"):
            name = event.rsplit("/", 1)[1].removesuffix("_duration")
            compile_s[name] += seconds
            counts[name] += 1
            fun = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # one row each
            per_fun[fun][name] += seconds
            per_fun[fun]["programs"] += name == "backend_compile"
            if name == "backend_compile":  # (when it ended, since the process started)
                timeline.append((time.perf_counter() - T_PROCESS, fun, seconds))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    t0 = time.perf_counter()  # (the engine opens the backend, beside its tokenizer's load)
    eng = make_engine(args, args.startup_child, max(int(x) for x in args.requests.split(",")))
    t_engine = time.perf_counter() - t0
    ready = time.perf_counter() - T_PROCESS
    t0 = time.perf_counter()  # one request at once (staged: on the first stage's programs)
    OfflineEngine(engine=eng).generate(input_ids=[list(range(1, PROMPT_LEN + 1))], sampling_params={
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    first = time.perf_counter() - t0
    staged = eng.background_warmup is not None
    if staged:
        eng.background_warmup.wait()
    print(json.dumps({"imports_s": t_imports, "backend_s": eng.backend_open_seconds,
                      "engine_s": t_engine,
                      "warmup_s": eng.warmup_seconds, "ready_s": ready,
                      "engine_phases": eng.startup_seconds,
                      "first_request_s": first, "staged": staged,
                      "all_compiled_s": time.perf_counter() - T_PROCESS,
                      "background": eng.background_warmup.status() if staged else None,
                      "compiles_before_ready": [t for t in timeline if t[0] <= ready],
                      "compile_s": dict(compile_s), "compile_counts": dict(counts),
                      "per_function": {k: dict(v) for k, v in per_fun.items()}}))
    eng.shutdown()


def startup(argv: list[str], cache_dir: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--startup-child", cache_dir],
                         capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    if out.returncode:
        raise RuntimeError(f"start-up child failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # The child's logged warnings (e.g. params placed otherwise than the first stage expected).
    r["warnings"] = [ln for ln in out.stderr.splitlines() if ln.startswith(("WARNING", "ERROR"))]
    return r


class PhaseTimer:
    """Wraps methods of the engine's objects; adds each call's wall seconds to ``totals``."""

    def __init__(self):
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        fn = getattr(obj, method)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[phase] += time.perf_counter() - t0

        own = vars(obj).get(method)  # a module's function or an instance attribute: put back
        setattr(obj, method, timed)
        self.undo.append(lambda: setattr(obj, method, own) if own is not None
                         else delattr(obj, method))

    def restore(self) -> None:
        for u in self.undo:
            u()


def _op_label(hlo: str) -> str:
    """A trace op's short label: its HLO name and opcode ("%gdn.55 custom-call"), not the
    whole instruction text the trace names it by."""
    name, _, rest = hlo.partition(" = ")
    op = re.search(r"[\]}\)] ([a-z][\w-]*)\(", rest)
    return f"{name} {op.group(1)}" if op else name


def device_busy_seconds(trace_dir: str) -> tuple[float, int, dict[str, float]]:
    """(seconds, executions, ops): the union of XLA module executions on the TPU devices of a
    ``jax.profiler`` trace, how many ran, and the device seconds of each op name (the "XLA
    Ops" line: fusions, Pallas custom calls, copies), summed; (nan, 0, {}) without a device
    plane."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    spans, ops = [], collections.defaultdict(float)
    for f in files:
        for plane in ProfileData.from_file(f).planes:
            if not plane.name.startswith("/device:TPU"):
                continue
            for line in plane.lines:
                if line.name == "XLA Modules":
                    spans += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
                elif line.name == "XLA Ops":
                    for e in line.events:
                        ops[_op_label(e.name)] += e.duration_ns * 1e-9
    if not spans:
        return float("nan"), 0, {}
    spans.sort()
    busy, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy * 1e-9, len(spans), dict(ops)


def serve_once(off: OfflineEngine, n: int, new_tokens: int) -> float:
    rng = np.random.default_rng(n)
    prompts = [rng.integers(3, 1000, PROMPT_LEN).tolist() for _ in range(n)]
    t0 = time.perf_counter()
    outs = off.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
    dt = time.perf_counter() - t0
    outs = outs if isinstance(outs, list) else [outs]
    assert sum(len(o["output_ids"]) for o in outs) == n * new_tokens
    return dt


def measure_serving(eng: Engine, n: int, new_tokens: int, profile: bool,
                    trace_out: str | None = None) -> dict:
    """Three runs of ``n`` requests: one to fill caches, one timed with the phase timers
    (tok/s and the split), then, with ``profile``, one under ``jax.profiler`` for the device's
    busy time alone (the profiler's tracing slows the host, so it times nothing else)."""
    off = OfflineEngine(engine=eng)
    serve_once(off, n, new_tokens)  # first run: compiles nothing (warm-up did), fills caches
    timer = PhaseTimer()
    runner, sched = eng.runner, eng.scheduler
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(runner, "prepare", "build")
    timer.wrap(runner, "forward", "dispatch")
    timer.wrap(runner, "sample", "dispatch")
    timer.wrap(multistep, "dispatch", "dispatch")  # a multi-step launch's one program
    timer.wrap(runner, "complete", "wait+d2h")
    timer.wrap(sched, "process_result", "process")
    timer.wrap(eng.loop.delivery, "deliver", "deliver")
    steps0 = eng.loop.stats["num_steps"]
    try:
        seconds = serve_once(off, n, new_tokens)
    finally:
        timer.restore()
    steps = eng.loop.stats["num_steps"] - steps0
    busy, execs, ops, profiled_s = _device_busy(off, n, new_tokens, trace_out) if profile else (
        float("nan"), 0, {}, float("nan"))
    top_ops = dict(sorted(((k, v / steps * 1e3) for k, v in ops.items()),
                          key=lambda kv: -kv[1])[:TOP_OPS])
    per_step = {k: v / steps * 1e3 for k, v in timer.totals.items()}
    return {"requests": n, "new_tokens": new_tokens, "seconds": seconds,
            "tok_per_s": n * new_tokens / seconds, "steps": steps,
            "step_ms": seconds / steps * 1e3, "phase_ms_per_step": per_step,
            "host_ms_per_step": sum(v for k, v in per_step.items() if k != "wait+d2h"),
            "device_busy_ms_per_step": busy / steps * 1e3, "device_executions": execs,
            "device_ops_ms_per_step": top_ops,
            "profiled_tok_per_s": n * new_tokens / profiled_s, "d2h_ms": _d2h_ms(n)}


def _device_busy(off: OfflineEngine, n: int, new_tokens: int, trace_out: str | None
                 ) -> tuple[float, int, dict[str, float], float]:
    """(device busy seconds, programs run, device seconds per op, wall seconds) of one run
    under the profiler."""
    trace = tempfile.mkdtemp(prefix="bench_engine-trace-")
    jax.profiler.start_trace(trace)
    try:
        seconds = serve_once(off, n, new_tokens)
    finally:
        jax.profiler.stop_trace()
    if trace_out:
        import shutil

        for f in glob.glob(f"{trace}/**/*.xplane.pb", recursive=True):
            shutil.copy(f, os.path.join(trace_out, f"requests{n}.xplane.pb"))
    return (*device_busy_seconds(trace), seconds)


def _d2h_ms(n: int) -> float:
    """The device-to-host copy alone of a step's sampled tokens, already computed (median ms)."""
    probe = jax.device_put(np.zeros((max(n, 8),), np.int32))
    jax.block_until_ready(probe)
    d2h = []
    for _ in range(20):
        x = probe + 1
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        jax.device_get(x)
        d2h.append(time.perf_counter() - t0)
    return statistics.median(d2h) * 1e3


def print_startup(name: str, r: dict) -> dict:
    """Print one start-up child's figures (``name``: which compilation cache); returns ``r``."""
    print(f"start-up, {name} compilation cache: ready {r['ready_s']:.1f} s after the "
          f"process started (imports {r['imports_s']:.1f} s, Engine {r['engine_s']:.1f} s "
          f"of which warm-up {r['warmup_s']:.1f} s"
          + (", staged" if r["staged"] else "") + f"); then one request of 16 tokens "
          f"{r['first_request_s']:.2f} s; every program compiled {r['all_compiled_s']:.1f} s "
          f"after the start" + (f" (background: {r['background']})" if r["staged"] else ""))
    print("   Engine by phase: " + ", ".join(
        f"{k} {v:.1f} s" for k, v in r["engine_phases"].items())
        + f" (the backend opened in {r['backend_s']:.1f} s on a thread beside the first)")
    print("   jax compile time: " + ", ".join(
        f"{k} {v:.1f} s ({r['compile_counts'][k]})" for k, v in r["compile_s"].items()))
    for line in r.get("warnings", []):
        print("   warning:", line[-300:])
    before = r["compiles_before_ready"]
    if before:  # where the time to ready went: the longest compiles and when they ended
        longest = sorted(before, key=lambda t: -t[2])[:TOP_N // 2]
        print(f"   {len(before)} compiles before ready, the last ending {before[-1][0]:.1f} s "
              "after the start; longest (function: compile s, ended at s): " + "; ".join(
                  f"{fun} {sec:.1f} @ {end:.1f}" for end, fun, sec in longest))
    top = sorted(r["per_function"].items(), key=lambda kv: -sum(
        v for k, v in kv[1].items() if k != "programs"))[:TOP_N]
    print("   by function (seconds summed over threads: trace / lower / compile, programs): "
          + "; ".join(f"{fun} {f.get('jaxpr_trace', 0):.1f}/{f.get('jaxpr_to_mlir_module', 0):.1f}"
                      f"/{f.get('backend_compile', 0):.1f} ({f.get('programs', 0):.0f})"
                      for fun, f in top), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--chunked-prefill-size", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens per KV page (default: the engine's)")
    ap.add_argument("--num-scheduler-steps", type=int, default=None,
                    help="decode steps per launch (multi-step decoding), as the server flag "
                         "(default: the engine's, 8 on a TPU and 1 elsewhere)")
    ap.add_argument("--warmup-in-background", action=argparse.BooleanOptionalAction,
                    default=None, help="staged warm-up (default: the engine's, on a TPU)")
    ap.add_argument("--no-profile", action="store_true", help="skip the jax.profiler trace")
    ap.add_argument("--trace-out", default=None,
                    help="copy each run's profiler trace (xplane.pb) into this directory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up children")
    ap.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.startup_child:
        return startup_child(args)
    counts = [int(x) for x in args.requests.split(",")]
    report: dict[str, Any] = {"dtype": args.dtype, "num_scheduler_steps": args.num_scheduler_steps}
    cache_dir = tempfile.mkdtemp(prefix="bench_engine-cc-")
    if not args.no_startup:  # before this process opens the backend (printed as they end)
        argv = [a for a in sys.argv[1:]]
        report["startup_cold"] = print_startup("an empty", startup(argv, cache_dir))
        report["startup_warm"] = print_startup("a filled", startup(argv, cache_dir))
    report["backend"], report["device_kind"] = jax.default_backend(), jax.devices()[0].device_kind
    if args.num_scheduler_steps is None:
        args.num_scheduler_steps = ServerArgs().scheduler_steps(report["backend"])
    report["num_scheduler_steps"] = args.num_scheduler_steps
    print(f"backend {report['backend']} ({report['device_kind']}), {args.dtype}, "
          f"--num-scheduler-steps {args.num_scheduler_steps}")
    eng = start(args, cache_dir, max(counts))
    report["serving"] = []
    try:
        for n in counts:
            r = measure_serving(eng, n, args.new_tokens, profile=not args.no_profile,
                                trace_out=args.trace_out)
            report["serving"].append(r)
            ph = "  ".join(f"{k} {v:.3f}" for k, v in r["phase_ms_per_step"].items())
            print(f"{n:4d} requests x {args.new_tokens} tokens: {r['tok_per_s']:9.0f} tok/s, "
                  f"{r['steps']} steps, {r['step_ms']:.3f} ms/step "
                  f"({r['seconds'] / args.new_tokens * 1e3:.3f} ms/token); host {r['host_ms_per_step']:.3f} "
                  f"ms/step, device busy {r['device_busy_ms_per_step']:.3f} ms/step "
                  f"({r['device_executions']} programs), d2h alone {r['d2h_ms']:.3f} ms; "
                  f"under the profiler {r['profiled_tok_per_s']:.0f} tok/s")
            print(f"     per step (ms): {ph}")
            if r["device_ops_ms_per_step"]:
                print("     device per step by op (ms): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r["device_ops_ms_per_step"].items()))
    finally:
        eng.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
