"""``/start_profile`` / ``/stop_profile``: one ``jax.profiler`` trace at a time.

A trace records host and device activity into ``<output_dir>/plugins/profile/<run>/``
(``*.xplane.pb``; TensorBoard's profile plugin or Perfetto read it). With ``num_steps`` the
engine's loop stops it after that many completed steps (``on_step``); in any case it stops by
itself after ``max_seconds``. The routes confine ``output_dir`` to the profile root
(``confine_output_dir``). Misuse (a second start, a stop with none running, a bad
``num_steps``, an ``output_dir`` outside the root) raises InvalidRequestError (HTTP 400).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import jax

from sglang_tpu_backend.managers.io_struct import InvalidRequestError
from sglang_tpu_backend.server_args import DEFAULT_PROFILE_MAX_SECONDS

logger = logging.getLogger(__name__)


def default_output_dir() -> str:
    """The default profile root (SGLang's default trace directory): ``$SGLANG_TORCH_PROFILER_DIR``,
    else the temp directory."""
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()


def confine_output_dir(output_dir: str | None, root: str | None) -> str:
    """The real path a trace asked into ``output_dir`` would be written to, which must lie in
    ``root`` (``None``: :func:`default_output_dir`).

    ``output_dir`` None is the root itself; a relative one is taken under the root. Symbolic
    links and ``..`` are resolved (``os.path.realpath``) before the check.

    Raises:
      InvalidRequestError("output_dir"): not a non-empty string, or it resolves outside root.
    """
    base = os.path.realpath(root or default_output_dir())
    if output_dir is None:
        return base
    if not isinstance(output_dir, str) or not output_dir or "\0" in output_dir:
        raise InvalidRequestError("output_dir", "output_dir must be a non-empty path string")
    path = os.path.realpath(os.path.join(base, output_dir))
    if os.path.commonpath([base, path]) != base:
        raise InvalidRequestError(
            "output_dir", f"output_dir {output_dir!r} resolves to {path}, outside the profile root "
            f"{base} (--profile-dir-root)")
    return path


class StepProfiler:
    """The trace state; thread-safe (HTTP handlers start/stop, the loop thread and the
    ``max_seconds`` timer auto-stop)."""

    def __init__(self, max_seconds: float = DEFAULT_PROFILE_MAX_SECONDS):
        self.max_seconds = max_seconds
        self._lock = threading.Lock()
        self.output_dir: str | None = None  # set while a trace runs
        self.stop_at_step: int | None = None  # engine step count that ends it (num_steps)
        self._timer: threading.Timer | None = None  # ends the running trace at max_seconds
        self._token: object | None = None  # the running trace's identity: a late timer of an
        # earlier trace must not stop a later one

    @property
    def running(self) -> bool:
        return self.output_dir is not None

    def start(self, output_dir: str | None, num_steps: int | None, current_step: int) -> str:
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                      or num_steps < 1):
            raise InvalidRequestError("num_steps", f"num_steps must be a positive integer, got {num_steps!r}")
        if output_dir is not None and (not isinstance(output_dir, str) or not output_dir):
            raise InvalidRequestError("output_dir", "output_dir must be a non-empty string")
        out = output_dir or default_output_dir()
        with self._lock:
            if self.running:
                raise InvalidRequestError(
                    "profile", f"profiling is already in progress (into {self.output_dir}); "
                    "call /stop_profile first")
            try:
                os.makedirs(out, exist_ok=True)
                jax.profiler.start_trace(out)
            except (OSError, RuntimeError) as e:
                raise InvalidRequestError("output_dir", f"output_dir {out!r}: cannot trace there: {e}") from e
            self.output_dir = out
            self.stop_at_step = None if num_steps is None else current_step + num_steps
            self._token = object()
            self._timer = threading.Timer(self.max_seconds, self._expire, args=(self._token,))
            self._timer.daemon = True
            self._timer.start()
        logger.info("profiling into %s%s (at most %g s)", out,
                    f" for {num_steps} steps" if num_steps else "", self.max_seconds)
        return out

    def _expire(self, token: object) -> None:
        with self._lock:
            if self.running and token is self._token:
                logger.warning("profile trace reached its limit of %g s (--profile-max-seconds): "
                               "stopping it", self.max_seconds)
                self._stop()

    def stop(self) -> str:
        with self._lock:
            if not self.running:
                raise InvalidRequestError("profile", "profiling is not in progress; "
                                          "call /start_profile first")
            return self._stop()

    def _stop(self) -> str:
        """Stop the trace and write it (lock held); returns its directory."""
        out, self.output_dir, self.stop_at_step = self.output_dir, None, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._token = None, None
        jax.profiler.stop_trace()
        logger.info("profile written to %s", out)
        return out

    def stop_if_running(self) -> None:
        with self._lock:
            if self.running:
                self._stop()

    def on_step(self, num_steps: int) -> None:
        """The loop completed its ``num_steps``-th step: end a trace whose steps are done."""
        if self.stop_at_step is None or num_steps < self.stop_at_step:
            return
        with self._lock:
            if self.stop_at_step is not None and num_steps >= self.stop_at_step:
                self._stop()
