"""JAX's persistent compilation cache, and a counter of compilations.

A server compiles every step program at warm-up. With the persistent cache on, XLA's
executables are written to a directory and a later start with the same model, flags and
jax/libtpu versions loads them instead of compiling (the cache key covers the program, the
compile options and the versions, so a stale entry is never used).

:class:`CompileCounter` counts what the process lowers to XLA (a persistent-cache hit
counts too: it is still a jit-cache miss that traced and lowered a program), through
``jax.monitoring``; a server after warm-up should count zero whatever the traffic.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_names = {"lowerings": [], "backend_compiles": []}  # function names, in order, per event
_counts_lock = threading.Lock()
_listening = False


def _on_duration(name: str, _secs: float, **kw) -> None:
    key = {_LOWERING_EVENT: "lowerings", _BACKEND_COMPILE_EVENT: "backend_compiles"}.get(name)
    if key is not None:
        with _counts_lock:
            _names[key].append(str(kw.get("fun_name", "?")))


def _listen() -> None:
    global _listening
    if not _listening:  # jax.monitoring listeners cannot be removed: register one, once
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True


class CompileCounter:
    """Programs lowered (``lowerings``) and XLA compilations run or loaded from the
    persistent cache (``backend_compiles``) in this process since the counter was made.

    Counts every thread, so measure with nothing else compiling."""

    def __init__(self):
        _listen()
        with _counts_lock:
            self._start = {key: len(names) for key, names in _names.items()}

    @property
    def lowerings(self) -> int:
        return len(self._names_since_start("lowerings"))

    @property
    def backend_compiles(self) -> int:
        return len(self._names_since_start("backend_compiles"))

    @property
    def lowered_names(self) -> list[str]:
        """The function name of each lowering counted (e.g. ``jit(forward)``), in order."""
        return self._names_since_start("lowerings")

    @property
    def compiled_names(self) -> list[str]:
        """The function name of each backend compile counted (e.g. ``jit(forward)``)."""
        return self._names_since_start("backend_compiles")

    def _names_since_start(self, key: str) -> list[str]:
        with _counts_lock:
            return _names[key][self._start[key]:]


def enable_persistent_cache(directory: str | Path) -> Path:
    """Write and reuse XLA executables under ``directory`` (process-wide; every program,
    however quick to compile). Returns the directory."""
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    current = jax.config.jax_compilation_cache_dir
    if current == str(path):
        return path
    if current:  # another directory was in use: let jax open the new one
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    logger.info("persistent compilation cache: %s", path)
    return path
