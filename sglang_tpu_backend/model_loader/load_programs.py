"""The device programs of a load onto accelerators, compiled on threads ahead of their use.

The accelerator path of ``sharded_loader`` writes every leaf it places into its param buffer
with a small jitted program, one per buffer shape, placement and kind of write:

  * ``zeros(s, sharding)``: a zeroed buffer allocated shard by shard on the devices (every
    stacked ``[groups, ...]`` leaf, and a top-level leaf written in row chunks);
  * ``writer("slot", sharding)(buf, x, g, swapped)``: one layer's leaf ``x`` into slot ``g``
    of a stacked buffer (transposed on the devices when it was read swapped);
  * ``writer("rows", sharding)(buf, x, lo, swapped)``: rows ``lo:`` of a 2-D leaf (columns
    when read swapped).

The buffer is donated to every write, so a write is in place. A checkpoint of one layer
period needs a few dozen such programs; compiled one after another on the loading thread
at first use they took most of a small load's time on a TPU (XLA:TPU compiles take about
0.1-0.3 s each). ``Precompiler`` lowers and compiles them on a thread pool (XLA compiles
outside the GIL) while the checkpoint is read; the loading thread ``wait``s for a program's
compile before its first call, which then finds it in its jit's cache and compiles nothing.
Each program is lowered on abstract arguments (``jax.ShapeDtypeStruct`` with the placement
the real call's arrays have), so the cache keys agree: ``tests/model/test_read_ahead.py``
counts the compiles left to the load.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

MAX_THREADS = 8  # compile threads (each holds its own XLA working memory)


def _finish(x: jax.Array, swapped: bool) -> jax.Array:
    return jnp.swapaxes(x, -1, -2) if swapped else x


def _write_slot(buf, x, g, swapped: bool):
    return buf.at[g].set(_finish(x, swapped))


def _write_rows(buf, x, lo, swapped: bool):
    at = (jnp.int32(0), lo) if swapped else (lo, jnp.int32(0))
    return jax.lax.dynamic_update_slice(buf, _finish(x, swapped), at)


@functools.lru_cache(maxsize=None)
def writer(kind: str, sharding: Any):
    """A jitted in-place write (the buffer donated) into a param buffer placed by
    ``sharding``: ``slot`` or ``rows`` (module doc). Kept for the process: later loads of the
    same shapes and placements compile nothing."""
    return jax.jit(_write_slot if kind == "slot" else _write_rows, static_argnums=3,
                   donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype: Any, sharding: Any):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zeros(s: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
    """A zeroed buffer of shape and dtype ``s`` allocated shard by shard on the devices."""
    return _zeros_fn(tuple(s.shape), jnp.dtype(s.dtype), sharding)()


def zeros_program(s: jax.ShapeDtypeStruct, sharding: Any) -> tuple[Hashable, Callable[[], Any]]:
    """(key, lowering) of the program of ``zeros(s, sharding)``."""
    fn = _zeros_fn(tuple(s.shape), jnp.dtype(s.dtype), sharding)
    return ("zeros", tuple(s.shape), jnp.dtype(s.dtype), sharding), fn.lower


def write_program(kind: str, buf: jax.ShapeDtypeStruct, sharding: Any, x_shape: tuple[int, ...],
                  x_sharding: Any, swapped: bool) -> tuple[Hashable, Callable[[], Any]]:
    """(key, lowering) of ``writer(kind, sharding)`` on a buffer like ``buf`` (placed by
    ``sharding``) and a leaf of ``x_shape`` (``buf``'s dtype) placed by ``x_sharding``."""
    def lower():
        return writer(kind, sharding).lower(
            jax.ShapeDtypeStruct(buf.shape, buf.dtype, sharding=sharding),
            jax.ShapeDtypeStruct(x_shape, buf.dtype, sharding=x_sharding), np.int32(0), swapped)
    key = (kind, tuple(buf.shape), jnp.dtype(buf.dtype), sharding, tuple(x_shape), x_sharding,
           swapped)
    return key, lower


class Precompiler:
    """Compiles programs on a thread pool, each once by key; ``wait(key)`` blocks until that
    one is compiled (re-raising its error). ``threads``: default one per core but one, at
    most ``MAX_THREADS``."""

    def __init__(self, threads: int | None = None):
        n = threads or max(1, min(MAX_THREADS, (os.cpu_count() or 2) - 1))
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="load-compile")
        self._futures: dict[Hashable, concurrent.futures.Future] = {}

    def submit(self, key: Hashable, lower: Callable[[], Any]) -> None:
        """Compile ``lower()`` unless a program of ``key`` was submitted already."""
        if key not in self._futures:
            self._futures[key] = self._pool.submit(lambda: lower().compile())

    def wait(self, key: Hashable) -> None:
        future = self._futures.get(key)
        if future is not None:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
