"""The scheduler loop thread: steps launched and completed, every phase guarded, health.

One step runs in four phases (``PHASES``): schedule, model (launch, then completion),
process_result and deliver. Between steps the loop also installs handed-over requests
("install"), exports finished prefills ("export"), swaps in new weights ("swap") and ends
profile traces ("profiler"). Every phase runs through ``guarded``: an Exception fails only the
requests that phase involves (finish_reason ``{"type": "abort", "message": "internal error:
<Type>: <msg>"}``, pages and slots freed, final outputs delivered), is counted
(``stats["num_errors"]``, ``sglang:num_step_errors_total{phase}``) and the loop lives on.

Health (``health_error``): the loop thread died (a BaseException), a step fault on a
multi-host replica (its processes' collectives are out of step: fatal, the loop stops),
``--max-consecutive-step-errors`` steps failed in a row, or the loop has had work without
completing a step for longer than ``--watchdog-timeout``. A failed step is not progress.

Overlap scheduling: the loop launches step i+1 before completing step i, so the host builds
the next step while the device runs the last one. A multi-step launch (``--num-scheduler-steps``
N > 1, ``ScheduledBatch.num_steps``) overlaps the same way: its requests' next input ids are
the Nth tokens, which the program leaves in the sampler's ``last_tokens``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from sglang_tpu_backend.managers.delivery import Delivery
from sglang_tpu_backend.managers.profiler import StepProfiler
from sglang_tpu_backend.managers.schedule_batch import Req, ScheduledBatch
from sglang_tpu_backend.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)
PHASES = ("schedule", "model", "process_result", "deliver")  # a step's phases
BETWEEN_STEPS = ("install", "export", "swap", "profiler")  # the loop's other guarded phases
T = TypeVar("T")
# Longest sleep of a loop with queued work that cannot run: the events that make room notify
# ``wake``; this bound only caps the cost of a state change that notified no one.
MAX_IDLE_WAIT_S = 1.0


class FatalStepError(BaseException):
    """A fault the replica cannot recover from; it ends the loop thread."""


class SchedulerLoop:
    """Owns the engine lock, the loop thread and its step / health state.

    Args:
      scheduler: decides what each step runs (plain Python).
      runner: ``ModelRunner`` (``launch`` / ``complete``).
      delivery: pushes outputs to the requests' consumers.
      metrics: ``EngineMetrics``.
      overlap: launch step i+1 before completing step i.
      watchdog_timeout: seconds with work and no completed step before health fails.
      max_consecutive_errors: failed steps in a row before health fails.
      fatal_step_faults: a step fault ends the loop (multi-host replicas).
      profile_max_seconds: a profile trace stops itself after this long.

    ``handover`` and ``weights`` (the managers of those loop phases) are attached by the
    engine after construction; both take ``lock`` for their own state.
    """

    def __init__(self, scheduler: Scheduler, runner: Any, delivery: Delivery, metrics: Any, *,
                 overlap: bool, watchdog_timeout: float, max_consecutive_errors: int,
                 fatal_step_faults: bool, profile_max_seconds: float):
        self.scheduler, self.runner, self.delivery, self.metrics = scheduler, runner, delivery, metrics
        self.overlap = overlap
        self.watchdog_timeout = watchdog_timeout
        self.max_consecutive_errors = max_consecutive_errors
        self.fatal_step_faults = fatal_step_faults
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.handover: Any = None  # HandoverManager
        self.weights: Any = None  # WeightUpdater
        self.profiler = StepProfiler(max_seconds=profile_max_seconds)
        self.stats = {"num_requests_total": 0, "prompt_tokens_total": 0,
                      "generation_tokens_total": 0, "num_steps": 0, "num_errors": 0}
        self.consecutive_errors = 0
        self.last_error: str | None = None
        self.loop_error: str | None = None  # why the loop thread ended (None while it runs)
        self.last_step_end = time.monotonic()  # the progress mark (watchdog)
        self.stopping = False
        # ``pause_generation``'s mode while paused (None: running): no step is launched; a
        # pending weight swap still runs. ``parked``: the thread waits with no step in flight.
        self.paused: str | None = None
        self.parked = False
        # Test hook: called with each phase name (PHASES, BETWEEN_STEPS) as the phase starts.
        self.fault_injector: Callable[[str], None] | None = None
        self.thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    # The thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, message: str, timeout: float = 30.0) -> bool:
        """Abort everything, end the thread; True when it has ended (or never ran)."""
        with self.lock:
            self.stopping = True
            self.abort_all(message)
            self.wake.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=timeout)
        return not self.thread.is_alive()

    @property
    def is_dead(self) -> bool:
        """The thread was started and has ended without ``stop``."""
        return self.thread.ident is not None and not self.thread.is_alive() and not self.stopping

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive()

    def _has_work(self) -> bool:
        if self.paused is not None:
            return self.weights.has_pending
        return (not self.scheduler.is_idle() or self.handover.has_pending
                or self.weights.has_pending)

    def wait_parked(self, timeout: float) -> bool:
        """Lock held, ``paused`` set: wait until the thread waits with no step in flight (True;
        also when no thread runs), or ``timeout`` seconds (False)."""
        return self.wake.wait_for(lambda: self.parked or not self.thread.is_alive(), timeout)

    def _run(self) -> None:
        """Launch step i+1, then complete step i (overlap), or one step at a time."""
        launched = None  # the step on the device whose outputs are not processed yet
        try:
            while True:
                with self.lock:
                    while not self.stopping and launched is None and not self._has_work():
                        self.parked = True
                        self.wake.notify_all()  # a pause waits for this
                        self.wake.wait()
                        self.parked = False
                        self.last_step_end = time.monotonic()  # idle is progress
                    if self.stopping:
                        return
                if self.weights.has_pending:  # (its deadline also runs with a step in flight)
                    in_flight = launched is not None
                    _, swapped = self.guarded("swap", lambda: self.weights.swap_if_idle(in_flight),
                                               self.weights.fail)
                    if swapped:
                        continue
                nxt = self._launch()
                completed = launched is not None
                if completed:
                    self._complete(launched)
                launched = nxt
                if launched is not None and not self.overlap:
                    self._complete(launched)
                    launched = None
                # Nothing could launch: sleep, unless a step just completed (its outputs may
                # be what a request waited for, e.g. a grammar's next mask: launch again now).
                if nxt is None and not completed:
                    self._wait_for_room()
        except BaseException as e:  # the phases recover from Exceptions; anything else ends it
            self.loop_error = f"{type(e).__name__}: {e}"
            logger.critical("scheduler loop died", exc_info=True)
            if self.lock.acquire(timeout=10):
                try:
                    self.abort_all(f"internal error: scheduler loop died: {self.loop_error}")
                finally:
                    self.lock.release()

    def _wait_for_room(self) -> None:
        """Work is queued but nothing can run (e.g. a handover waits for pages while nothing
        else runs): sleep until an arrival, abort, cache flush or update notifies ``wake``,
        or until the next deadline of a waiting handover or weight update."""
        with self.lock:
            if self.stopping:
                return
            deadlines = [d for d in (self.handover.next_deadline, self.weights.deadline)
                         if d is not None]
            timeout = min([d - time.monotonic() for d in deadlines] + [MAX_IDLE_WAIT_S])
            self.wake.wait(timeout=max(timeout, 0.0))

    # One step --------------------------------------------------------------------------------
    def step(self) -> ScheduledBatch | None:
        """One step, completed before returning (callers that drive the engine themselves);
        the batch, or None when nothing ran."""
        launched = self._launch()
        if launched is not None:
            self._complete(launched)
        return None if launched is None else launched.batch

    def _launch(self):
        """Schedule a step and dispatch it to the device; None when nothing runs now (or
        generation is paused)."""
        if self.paused is not None:
            return None
        if self.handover.has_pending:
            self.guarded("install", self.handover.install_pending, self.handover.fail_installs)
        with self.lock:
            ok, batch = self.guarded("schedule", self.scheduler.schedule, self._fail_scheduled)
        if not ok or batch is None:
            return None
        ok, launched = self.guarded("model", lambda: self.runner.launch(batch),
                                    lambda msg: self._fail_step(batch, "model", msg))
        if not ok:
            return None
        with self.lock:
            self.scheduler.on_launch(batch)
        return launched

    def _complete(self, launched) -> None:
        """Fetch a launched step's outputs, advance its requests, deliver their outputs."""
        batch = launched.batch

        def fail(phase: str) -> Callable[[str], None]:
            return lambda msg: self._fail_step(batch, phase, msg)

        ok, results = self.guarded("model", lambda: self.runner.complete(launched), fail("model"))
        if not ok:
            return
        with self.lock:
            ok, touched = self.guarded("process_result", lambda: self._process(batch, results),
                                       fail("process_result"))
            if not ok:
                return
            ok, _ = self.guarded("deliver", lambda: self.delivery.deliver(touched), fail("deliver"))
            if not ok:
                return
        if self.scheduler.exported:
            self.guarded("export", self.handover.export_finished, self.handover.fail_exports)
        self.guarded("profiler", lambda: self.profiler.on_step(self.stats["num_steps"]),
                     lambda msg: self.profiler.stop_if_running())
        self.consecutive_errors = 0
        self.last_step_end = time.monotonic()

    def _process(self, batch: ScheduledBatch, results: list) -> list[Req]:
        before = {id(c.req): len(c.req.output_ids) for c in batch.chunks if c.sample}
        touched = self.scheduler.process_result(batch, results)
        self.stats["num_steps"] += 1
        # Tokens appended (a run's tokens past a finish are dropped, not generated).
        self.stats["generation_tokens_total"] += sum(
            len(c.req.output_ids) - before.pop(id(c.req))
            for c in batch.chunks if id(c.req) in before)
        self.metrics.on_step(batch.chunks, touched)
        if batch.kind.is_verify():
            self.metrics.on_verify(batch.chunks, results)
        if self.runner.last_router_stats is not None:
            self.metrics.on_router_stats(self.runner.last_router_stats)
        return touched

    # Faults ----------------------------------------------------------------------------------
    def guarded(self, phase: str, fn: Callable[[], T],
                fail: Callable[[str], None]) -> tuple[bool, T | None]:
        """Run one phase: ``(True, fn())``, or on an Exception ``(False, None)`` after it was
        logged and counted and ``fail(message)`` ended the requests it involved. On a
        multi-host replica a step fault raises FatalStepError (ends the loop)."""
        try:
            if self.fault_injector is not None:
                self.fault_injector(phase)
            return True, fn()
        except Exception as e:
            msg = f"internal error: {type(e).__name__}: {e}"
            logger.error("phase %s failed", phase, exc_info=e)
            with self.lock:
                self.stats["num_errors"] += 1
                self.metrics.on_step_error(phase)
                if phase in PHASES:
                    self.consecutive_errors += 1
                self.last_error = f"{phase}: {msg}"
                try:
                    fail(msg)
                except Exception:
                    logger.exception("ending the requests of the failed %s phase failed", phase)
            if phase in PHASES and self.fatal_step_faults:
                raise FatalStepError(
                    f"a {phase} fault on a multi-host replica leaves its processes out of step "
                    f"({msg}); restart the replica") from e
            return False, None

    def _fail_scheduled(self, msg: str) -> None:
        for req in self.scheduler.fail_all(msg):
            self.delivery.deliver_final(req)

    def _fail_step(self, batch: ScheduledBatch, phase: str, msg: str) -> None:
        """Abort a failed step's requests (pages and slots freed), give back the snapshots
        it had not committed, deliver every request's final output (one that finished
        normally before the fault keeps its own finish_reason). Lock held."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.discard(batch.state_saves)  # what commit left
        for c in batch.chunks:
            req = c.req
            if c.sample and phase != "process_result":  # (process_result took it back already)
                req.num_inflight = max(0, req.num_inflight - batch.num_steps)
            if self.scheduler.abort(req.rid, msg) is None and not req.finished:
                continue  # not the scheduler's any more (handover export path)
            self.delivery.deliver_final(req)

    def abort_all(self, message: str, held: bool = True) -> None:
        """Abort every queued, running and installing request, and (``held``) those held
        for a weight swap, and deliver them. Lock held."""
        for req in list(self.scheduler.all_requests()):
            self.scheduler.abort(req.rid, message)
            self.delivery.deliver_final(req)
        self.handover.abort_pending(message)
        if held:
            self.weights.abort_held(message)

    # Health ----------------------------------------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the loop has had work without completing a step (0 when idle; inf when
        the thread is dead)."""
        if self.is_dead:
            return float("inf")
        with self.lock:
            if self.paused is not None or (self.scheduler.is_idle() and not self.handover.has_pending):
                return 0.0
        return max(0.0, time.monotonic() - self.last_step_end)

    def health_error(self) -> str | None:
        """Why this loop cannot serve, or None."""
        if self.is_dead:
            return f"the scheduler loop died ({self.loop_error or 'no error recorded'})"
        n = self.consecutive_errors
        if n >= self.max_consecutive_errors:
            return (f"the last {n} steps failed (--max-consecutive-step-errors "
                    f"{self.max_consecutive_errors}); last: {self.last_error}")
        stalled = self.stalled_for()
        if stalled > self.watchdog_timeout:
            return (f"the scheduler loop has made no progress for {stalled:.0f} s "
                    f"(--watchdog-timeout {self.watchdog_timeout:g})")
        return None
