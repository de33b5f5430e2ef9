"""An engine's start-up: its seconds by phase, and the backend opened beside the tokenizer.

On a TPU host, opening JAX's backend (libtpu finding and initialising the chip) takes seconds,
and reading the tokenizer and the model's config (most of it importing transformers) needs no
device. ``BackendOpener`` starts the open on a thread so the two may overlap; the engine then
waits for the devices where it first needs them. They overlap little: on a v5e host the open
(6.4-7.5 s on its own, no transparent huge pages there) holds the GIL for most of its time.
Measured there in one session: one after the other (tokenizer and config 2.4-2.6 s, then the
open 6.3-7.5 s) both were done 8.7-10.0 s after the engine began in three runs; side by side,
7.8-8.3 s in four runs and 5.8-6.2 s in two (the open alone 5.8-6.1 s on its thread).
"""

from __future__ import annotations

import threading
import time

import jax


class StartupPhases:
    """Wall seconds of an engine's start-up, by phase: ``end(name)`` adds the time since the
    previous ``end`` (or construction) to ``seconds[name]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


class BackendOpener:
    """Opens JAX's default backend on a thread (``jax.devices()``); ``devices()`` waits for it
    and returns the devices, raising the open's error where it failed. ``seconds``: how long
    the open took on its thread (None until it ends)."""

    def __init__(self):
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._open, name="backend-open", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        t0 = time.perf_counter()
        try:
            jax.devices()
        except Exception:  # noqa: BLE001 -- devices() below raises it on the caller's thread
            pass
        self.seconds = time.perf_counter() - t0

    def devices(self) -> list:
        self._thread.join()
        return jax.devices()
