"""Recycled host buffers for the accelerator load path's reads.

The accelerator path of ``sharded_loader`` reads every leaf into host memory on the
read-ahead threads, hands it to the devices and lets it go. Read into fresh memory, each
read first faults its pages in (the kernel allocating and zeroing them), which scales poorly
across the reading threads: on a v5e host one thread read into a reused buffer at 2.5 GB/s,
into fresh memory at 1.37 GB/s. Consecutive layers repeat the same leaf shapes, so
``HostPool`` keeps the buffers of leaves the devices have and hands them to later reads of
the same ``(shape, dtype)``:

  * ``get(shape, dtype)``: a returned buffer of that shape and dtype (the most recently
    returned one); else the memory of a returned buffer of the same bytes, else of the
    smallest one of at most ``REUSE_SLACK`` times the bytes, as a view of that shape and
    dtype (the embeddings' row chunks serve the first layer's leaves, which would otherwise
    all read into fresh memory); else a fresh one (``host_load.host_empty``: page-aligned,
    huge-page advised). Thread-safe: the read-ahead threads call it.
  * ``put(buf)``: ``buf`` back in the pool; only once nothing reads it any more (the
    loader: once the placed leaf's transfer, or the write that consumed it, is done); a
    view is returned as the buffer it views. Arrays the pool did not hand out are ignored
    (leaves read without a buffer).
  * ``drop(buf)``: ``buf`` no longer counted (kept by someone else, e.g. a CPU device
    array aliasing it); it is never handed out again.

The pool bounds the host memory it holds: the bytes handed out and not yet returned plus
the bytes kept for reuse stay at most ``cap_bytes`` (the loader's: what it reads ahead plus
the leaves in flight, the host memory it held without a pool). Kept buffers are let go
oldest first where keeping them, or a fresh allocation, would pass the cap; if the buffers
handed out alone pass it, nothing is kept.

``leaf_read(pool, leaf, shape, dtype, *args)``: ``leaf.read(*args)`` into a pooled buffer
of that shape where the leaf can fill one (``Leaf.into``), else ``leaf.read(*args)``.
``retire(out, x, bufs, pool)``: wait until a placed leaf is written, then return its host
buffers (see its docstring for when a buffer may go back).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import jax
import numpy as np

from sglang_tpu_backend.model_loader.host_load import aliases, host_empty


REUSE_SLACK = 2  # a get may take a returned buffer of up to this many times its bytes


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


class HostPool:
    """Host buffers by ``(shape, dtype)``, reused; at most ``cap_bytes`` held (module doc).

    Counters: ``recycled`` (gets served by a returned buffer), ``fresh`` (gets that
    allocated), ``evicted`` (returned buffers let go to stay under the cap)."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.recycled = self.fresh = self.evicted = 0
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []  # kept for reuse, oldest first
        self._free_bytes = 0
        self._out: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # handed out, not returned:
        self._out_bytes = 0  # id -> (array handed out, the buffer whose memory it is)

    @property
    def held_bytes(self) -> int:
        """Bytes handed out and not returned, plus bytes kept for reuse."""
        return self._out_bytes + self._free_bytes

    def _evict(self, extra: int) -> None:
        """Let kept buffers go, oldest first, until ``extra`` more bytes fit under the cap."""
        while self._free and self._out_bytes + self._free_bytes + extra > self.cap_bytes:
            self._free_bytes -= self._free.pop(0).nbytes
            self.evicted += 1

    def _kept(self, shape: tuple[int, ...], dtype: np.dtype) -> int | None:
        """Index in ``_free`` of the buffer to serve a get (module doc), or None."""
        n = _nbytes(shape, dtype)
        same = [k for k, b in enumerate(self._free) if b.shape == shape and b.dtype == dtype]
        same = same or [k for k, b in enumerate(self._free) if b.nbytes == n]
        if same:
            return same[-1]  # the most recently returned
        fits = [(b.nbytes, k) for k, b in enumerate(self._free)
                if n < b.nbytes <= REUSE_SLACK * n]
        return min(fits)[1] if fits else None

    def get(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A C-contiguous ``dtype[shape]`` buffer (maybe a view of a larger one), its
        contents undefined."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            k = self._kept(shape, dtype)
            if k is not None:
                base = self._free.pop(k)
                self._free_bytes -= base.nbytes
                buf = base if base.shape == shape and base.dtype == dtype else (
                    base.reshape(-1).view(np.uint8)[:_nbytes(shape, dtype)]
                    .view(dtype).reshape(shape))
                self._out[id(buf)] = (buf, base)
                self._out_bytes += base.nbytes
                self.recycled += 1
                return buf
            n = _nbytes(shape, dtype)
            self._evict(n)
            self._out_bytes += n
            self.fresh += 1
        buf = host_empty(shape, dtype)
        with self._lock:
            self._out[id(buf)] = (buf, buf)
        return buf

    def _take_back(self, buf: np.ndarray) -> np.ndarray | None:
        """Stop counting ``buf`` as handed out; the buffer whose memory it is, None where the
        pool did not hand it out."""
        got = self._out.get(id(buf))
        if got is None or got[0] is not buf:
            return None
        del self._out[id(buf)]
        self._out_bytes -= got[1].nbytes
        return got[1]

    def put(self, buf: np.ndarray) -> None:
        """Return ``buf`` (nothing reads or writes it any more) for reuse."""
        with self._lock:
            base = self._take_back(buf)
            if base is not None:
                self._free.append(base)
                self._free_bytes += base.nbytes
                self._evict(0)

    def drop(self, buf: np.ndarray) -> None:
        """Forget ``buf``: it is never handed out again."""
        with self._lock:
            self._take_back(buf)

    def counts(self) -> dict[str, int]:
        return {"recycled": self.recycled, "fresh": self.fresh, "evicted": self.evicted}


def leaf_read(pool: HostPool | None, leaf: Any, shape: tuple[int, ...], dtype: Any,
              *args) -> np.ndarray:
    """What ``leaf.read(*args)`` returns (``dtype[shape]``), read into a buffer from ``pool``
    where ``leaf`` has an ``into`` (a ``loader.Leaf`` filling a given buffer); else (or
    without a pool) ``leaf.read(*args)``'s own array. A failed read's buffer is dropped."""
    if pool is None or leaf.into is None:
        return leaf.read(*args)
    out = pool.get(shape, dtype)
    try:
        leaf.into(out, *args)
    except BaseException:
        pool.drop(out)
        raise
    return out


def retire(out: jax.Array, x: jax.Array, bufs: list[np.ndarray], pool: HostPool) -> None:
    """Wait until the placed leaf ``x``, read into host arrays ``bufs``, is written into its
    param (``out``: what ``sharded_loader._write`` returned), then return ``bufs`` to
    ``pool``: after the write (which consumed ``x``) where ``out`` is still there; where
    ``out`` is ``x`` itself or was donated to a later write (the row chunks of one leaf),
    once ``x`` is on the devices (its transfer done), unless ``x`` kept the host arrays as
    its buffers (CPU devices): those are dropped, never reused."""
    if out is not x and not out.is_deleted():
        out.block_until_ready()
        done = True
    else:
        x.block_until_ready()
        done = not aliases(x, bufs)
    for b in bufs:
        if done:
            pool.put(b)
        else:
            pool.drop(b)
