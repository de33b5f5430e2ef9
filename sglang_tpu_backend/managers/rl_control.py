"""SGLang's RL controls over one engine: pause / continue generation and sleep / wake.

``pause_generation(mode)`` stops the scheduler loop from launching steps (the step in flight
completes first; the call returns once the loop waits with none in flight):

- ``"abort"``: every queued, running and held request ends with finish_reason ``abort``;
- ``"retract"``: every running request gives back its KV pages and GDN slot and goes back to
  the front of the waiting queue (oldest first), keeping its output so far; after
  ``continue_generation`` it is prefilled again (prompt + output so far) and goes on, so a
  greedy request's tokens are those of an uninterrupted run;
- ``"in_place"``: nothing moves; the requests keep their pages and slots and resume.

While paused, new requests queue (they run after ``continue_generation``), and weight updates
swap at once without waiting for the paused requests (``weight_updater.swap_if_idle``; after
an in-place pause their KV was computed with the old weights, as in SGLang).

``release_memory_occupation(tags)`` frees the device memory of ``kv_cache`` and / or
``weights`` (None: both; ``model_executor/memory_release.py``) and
``resume_memory_occupation(tags)`` brings it back with the same placements (nothing
recompiles). Releasing needs an empty engine (no request queued, running, held or being
installed; else ``RLStateError``); the prefix cache is flushed first. While anything is
released no step runs, generate requests are refused (``ServiceUnavailableError``) and a
weight update is refused while the weights are released.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_tpu_backend.managers.io_struct import InvalidRequestError, ServiceUnavailableError
from sglang_tpu_backend.model_executor.memory_release import TAGS, DeviceMemory

logger = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")
RELEASED = "memory released"  # the loop's gate while released and not paused
PARK_TIMEOUT_S = 60.0


class RLStateError(InvalidRequestError):
    """A control call that the engine's state does not allow now (HTTP 400 naming ``field``)."""


def check_tags(tags: list[str] | None) -> list[str]:
    """SGLang's ``tags`` (None: all) as a list; InvalidRequestError naming an unknown one."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequestError("tags", f"tags must be a list of strings from {list(TAGS)}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise InvalidRequestError("tags", f"unknown memory tag(s) {bad}; known: {list(TAGS)}")
    return list(dict.fromkeys(tags))


class RLControl:
    """Pause state and released memory of one engine (``loop``: its ``SchedulerLoop``,
    ``runner``: its ``ModelRunner``)."""

    def __init__(self, loop: Any, runner: Any):
        self.loop, self.runner = loop, runner
        self.mode: str | None = None  # pause_generation's mode while paused
        self.memory = DeviceMemory(runner)

    @property
    def released(self) -> list[str]:
        """The tags released now."""
        return sorted(self.memory.released)

    def _gate(self) -> None:
        """Lock held: the loop launches nothing while paused or released."""
        self.loop.paused = self.mode or (RELEASED if self.memory.released else None)
        self.loop.wake.notify_all()

    def _park(self) -> None:
        """Lock held, gate set: wait for the loop to have no step in flight."""
        if not self.loop.wait_parked(PARK_TIMEOUT_S):
            raise ServiceUnavailableError(f"the scheduler loop did not stop stepping within "
                                          f"{PARK_TIMEOUT_S:g} s")

    # Admission --------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Lock held: refuse a new request while memory is released."""
        if self.memory.released:
            raise ServiceUnavailableError(
                f"the engine's memory is released ({', '.join(self.released)}: "
                "release_memory_occupation); call resume_memory_occupation first")

    def check_weights_present(self) -> None:
        if "weights" in self.memory.released:
            raise RLStateError("tags", "the weights are released (release_memory_occupation); "
                               "resume_memory_occupation(['weights']) before updating them")

    # Pause ------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> dict:
        """Pause as ``mode`` says (see the module doc); returns ``{"success", "mode",
        "num_aborted", "num_retracted"}``. Pausing again changes the mode (``abort`` and
        ``retract`` act again on what runs)."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError("mode", f"mode must be one of {list(PAUSE_MODES)}, not {mode!r}")
        loop = self.loop
        with loop.lock:
            self.mode = mode
            self._gate()
            self._park()
            aborted = retracted = 0
            if mode == "abort":
                aborted = sum(1 for _ in loop.scheduler.all_requests()) + len(loop.weights.held)
                loop.abort_all("Aborted by pause_generation(mode='abort')")
            elif mode == "retract":
                retracted = loop.scheduler.retract_all()
            loop.wake.notify_all()  # freed pages may admit a waiting handover after continue
        logger.info("generation paused (%s): %d aborted, %d retracted", mode, aborted, retracted)
        return {"success": True, "mode": mode, "num_aborted": aborted, "num_retracted": retracted}

    def continue_generation(self) -> dict:
        """Resume stepping (what queued meanwhile runs now). ``{"success"}``."""
        with self.loop.lock:
            self.mode = None
            self._gate()
        return {"success": True}

    # Sleep and wake ---------------------------------------------------------------------
    def _check_empty(self) -> None:
        loop = self.loop
        n = sum(1 for _ in loop.scheduler.all_requests()) + len(loop.weights.held)
        if n or loop.handover.has_pending or loop.weights.has_pending:
            raise RLStateError(
                "tags", f"cannot release memory while {n} request(s) are queued or running "
                "(or a handover / weight update is pending): let them finish, or "
                "pause_generation(mode='abort') first")

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Free the device memory of ``tags`` (None: all). ``{"success", "tags" (released
        now), "freed_bytes"}``. RLStateError while requests are in the engine."""
        tags = check_tags(tags)
        if not self.runner.backend.weight_updates:  # (the multi-host backend)
            raise RLStateError("tags", "releasing memory is not supported with --nnodes > 1 "
                               "(each process holds its own shards)")
        loop = self.loop
        with loop.weights.updates_lock, loop.lock:  # (an update in progress finishes first)
            self._check_empty()
            before = loop.paused
            loop.paused = loop.paused or RELEASED
            try:
                self._park()
                self._check_empty()  # (nothing can arrive while we hold the lock)
            except Exception:
                loop.paused = before
                raise
            if loop.scheduler.prefix is not None:
                loop.scheduler.prefix.flush()  # its pages' KV is about to go
            try:
                freed = self.memory.release(tags)
            finally:
                self._gate()
        logger.info("released device memory %s: %.1f MiB", tags, freed / 2**20)
        return {"success": True, "tags": self.released, "freed_bytes": freed}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Place ``tags`` (None: all) again as they were; ``{"success", "tags" (still
        released)}``."""
        tags = check_tags(tags)
        with self.loop.weights.updates_lock, self.loop.lock:
            try:
                self.memory.resume(tags)
            finally:
                self._gate()
        return {"success": True, "tags": self.released}
