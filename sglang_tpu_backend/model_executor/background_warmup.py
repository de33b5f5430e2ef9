"""Ready before every program is compiled: the warm-up in two stages (one device).

Compiling every step bucket's programs before the first request (``warmup.py``) is most of
an engine's start-up on a TPU: a v5e host took 104 s to ready with the tiny model, most of it
lowering and compiling some 40 forward, multi-step and sampler programs. A staged warm-up
(``--warmup-in-background``, the default on a TPU) compiles

  1. before the engine is ready, what can serve any step, only slower: the smallest MIXED
     bucket that holds a decode step of every running request
     (``StepBuckets.first_shapes``) with its samplers (every variant and top-logprob count),
     plus what every warm-up does (penalty rows, prefix-cache snapshot copies), compiled and
     run by ``warmup.warm_up`` as before. Until stage 2 ends, steps take only that shape
     (``StepBuckets.ready``: a decode step runs as that MIXED step), the scheduler's step
     budget is its T tokens (a long prompt takes more chunks) and decode launches are
     single steps;
  2. in the background while the engine serves, every other program
     (``parallel_compile.tasks``: the other buckets' forwards, the multi-step programs, the
     other samplers), lowered one after another on a thread and compiled on a pool
     (``compile_threads`` workers). None of them runs, so nothing touches the live cache.
     When every one is compiled the limits are lifted: the runner's buckets first, then the
     scheduler's budget and steps, so a step the scheduler then forms has its program.

The lowering runs on ``_Abstract(runner)``: the params, cache and sampler state as
``ShapeDtypeStruct``s (shape, dtype, placement and layout) taken when stage 2 starts, while
they are live; the serving loop donates and replaces those arrays every step. Arguments of
the same shape, dtype, placement and layout give the serving call the same cache key, so a
bucket's first step finds its executable compiled (``tests/engine/test_background_warmup.py``
counts the compiles after stage 2). A failed compile is logged and leaves the limits in
place: the engine keeps serving on stage 1's programs.

Not staged (the whole warm-up before ready): DP, TP or multi-host backends, speculative
decoding, deterministic inference, disaggregated prefill / decode roles and EPLB
rebalancing (``applies``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import numpy as np

from sglang_tpu_backend.model_executor import host_inputs, parallel_compile, warmup
from sglang_tpu_backend.model_executor.sampler_state import unpack_batch_jit

logger = logging.getLogger(__name__)


def applies(runner: Any, role: str) -> bool:
    """Whether ``runner`` (in an engine of ``role``) can warm up in two stages."""
    rebalances = runner.balancer is not None and runner.balancer.rebalance_every is not None
    return (parallel_compile.supported(runner) and runner.num_drafts == 0
            and not runner.buckets.deterministic and role not in ("prefill", "decode")
            and not rebalances)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.format)
                        if isinstance(x, jax.Array) else x, tree)


class _Abstract:
    """``runner`` for lowering off the serving thread: its params, cache and sampler state as
    ShapeDtypeStructs taken now, and ``place_batch`` abstract too (below); every other
    attribute is the runner's."""

    def __init__(self, runner: Any):
        self._runner = runner
        self.params, self.cache = _abstract(runner.params), _abstract(runner.cache)
        self.sampler = copy.copy(runner.sampler)
        for name in ("counts", "prompt_mask", "last_tokens"):
            setattr(self.sampler, name, _abstract(getattr(runner.sampler, name)))
        self._placed: dict[Any, Any] = {}  # (buffer words, layout) -> the placed batch
        self.placing_programs = 0  # unpack programs compiled by place_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def place_batch(self, fbs: list, from_slot: None) -> tuple[list, None]:
        """``runner.place_batch`` of one all-padding numpy batch without running anything:
        its unpack program (``unpack_batch_jit``, which serving runs on the live last
        tokens) compiled here, once per layout, and its outputs as ShapeDtypeStructs of
        that program's output placements and layouts."""
        (fb,) = fbs
        buf, layout = host_inputs.pack((fb, np.full(fb.input_ids.shape, -1, np.int32)))
        key = (buf.size, layout)
        if key not in self._placed:
            where = jax.sharding.SingleDeviceSharding(self._runner.backend.device)
            lowered = unpack_batch_jit.lower(
                jax.ShapeDtypeStruct(buf.shape, buf.dtype, sharding=where),
                self.sampler.last_tokens, layout=layout)
            compiled = lowered.compile()
            self.placing_programs += 1
            self._placed[key] = jax.tree.map(
                lambda s, f: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f),
                lowered.out_info, compiled.output_formats)
        return [self._placed[key]], None


class BackgroundWarmup:
    """Stage 2 of a staged warm-up (module doc), started by ``start``. ``status()`` says how
    far it is; ``stop()`` ends it (the compiles running finish first)."""

    def __init__(self, runner: Any, scheduler: Any, compile_threads: int):
        first = runner.buckets.first_shapes()
        rest = [s for s in runner.all_shapes() if s not in first]
        self._abstract = _Abstract(runner)
        self._tasks = parallel_compile.tasks(self._abstract, rest,
                                             frozenset((s[2], s[3]) for s in first))
        self._runner, self._scheduler = runner, scheduler
        self._limits = (scheduler.max_tokens_per_step, scheduler.num_scheduler_steps)
        runner.buckets.ready = frozenset(first)
        scheduler.max_tokens_per_step = min(self._limits[0], first[0][1])
        scheduler.num_scheduler_steps = 1
        self.compiled, self.error, self.seconds = 0, None, None
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="warmup-background")
        self._thread = threading.Thread(target=self._run, name="warmup-background", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.seconds is not None

    def _compile(self, lowered: Any) -> None:
        if not self._stop.is_set():
            lowered.compile()  # the executable lives on in its jit's cache
            with self._lock:
                self.compiled += 1

    def _run(self) -> None:
        try:
            pending = []
            for task in self._tasks:
                if self._stop.is_set():
                    return
                pending.append(self._pool.submit(self._compile, task()))
            for f in pending:
                f.result()
        except Exception as e:  # noqa: BLE001 -- keep serving on stage 1's programs
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("background warm-up failed; serving stays on its first programs")
            return
        if self._stop.is_set():
            return
        self._runner.buckets.ready = None  # the runner takes every shape before the
        self._scheduler.max_tokens_per_step, self._scheduler.num_scheduler_steps = self._limits
        self.seconds = time.perf_counter() - self._t0  # scheduler forms them
        logger.info("background warm-up compiled %d programs in %.1f s", self.compiled,
                    self.seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stage 2 ends (or ``timeout`` seconds); returns whether it is done."""
        self._thread.join(timeout)
        return self.done

    def status(self) -> dict:
        stage = "complete" if self.done else "failed" if self.error else "background"
        return {"stage": stage, "step_programs_compiled": self.compiled,
                "step_programs_total": len(self._tasks),
                "batch_placing_programs": self._abstract.placing_programs,
                "seconds": self.seconds, "error": self.error}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)


class FirstStage:
    """Stage 1's step programs (``parallel_compile.precompile`` of the first shapes, without
    the snapshot copies, which need the runner built) lowered and compiled on a thread while
    the runner's weights load, started by ``ModelRunner``'s ``before_load``: ``runner.params``
    are then the placed shapes the loaded params will have (``Backend.placed_param_shapes``),
    so the warm-up's runs on the loaded params find these programs compiled. ``wait()``
    re-raises a failure. (Where the load fails, the thread finishes on its own: a daemon.)

    The constructor returns once the first program, the forward, has been lowered: its trace
    and lowering are Python, and beside the loader's Python they took turns on the GIL (on a
    v5e its compile began 5.9 s into the runner phase; its trace and lowering alone take
    ~3.4 s). Its compile, outside the GIL, then runs through the load, and the rest lower
    beside the load."""

    def __init__(self, runner: Any, compile_threads: int):
        self.placed = runner.params  # the placed shapes lowered on
        self._error: BaseException | None = None
        first_lowered = threading.Event()
        self._thread = threading.Thread(target=self._compile,
                                        args=(runner, compile_threads, first_lowered.set),
                                        name="warmup-first-stage", daemon=True)
        self._thread.start()
        first_lowered.wait()

    def _compile(self, runner: Any, threads: int, first_lowered: Callable[[], None]) -> None:
        try:
            parallel_compile.precompile(runner, runner.buckets.first_shapes(), threads,
                                        snapshots=False, first_lowered=first_lowered)
        except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
            self._error = e
        finally:
            first_lowered()  # (a failure before the first lowering must not hang the load)

    def wait(self) -> None:
        """Block until every program is compiled; raises the first failure."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def placed_otherwise(self, params: Any) -> list[str]:
        """Paths of the loaded ``params`` whose shape, dtype, sharding or layout differ from
        the placed shapes lowered on (the serving calls then miss these programs)."""
        def differs(p: jax.ShapeDtypeStruct, x: jax.Array) -> bool:
            layout = getattr(p.format, "layout", None)  # None: the default layout
            return ((p.shape, p.dtype, p.sharding) != (x.shape, x.dtype, x.sharding)
                    or (layout is not None and layout != x.format.layout))
        flat = jax.tree_util.tree_flatten_with_path(self.placed)[0]
        return [jax.tree_util.keystr(path) for (path, p), x in zip(flat, jax.tree.leaves(params))
                if differs(p, x)]


def start(runner: Any, scheduler: Any, progress: bool, compile_threads: int,
          first_stage: FirstStage | None = None) -> tuple[float, BackgroundWarmup]:
    """Stage 1 (returns its seconds; its step programs compiled by ``first_stage`` when
    given), then stage 2 started in the background."""
    t0 = time.perf_counter()
    if first_stage is not None:
        first_stage.wait()
        if otherwise := first_stage.placed_otherwise(runner.params):
            logger.warning("%d params were loaded placed otherwise than the first stage's "
                           "programs were lowered (%s): those compile again", len(otherwise),
                           ", ".join(otherwise[:4]))
    warmup.warm_up(runner, progress, compile_threads, runner.buckets.first_shapes(),
                   precompiled=first_stage is not None)
    return time.perf_counter() - t0, BackgroundWarmup(runner, scheduler, compile_threads)
