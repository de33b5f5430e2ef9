"""Loading onto CPU devices: each byte read once, straight into the memory that keeps it.

On a CPU device a "device buffer" is host memory, and ``jax.device_put`` of a page-aligned
numpy array makes a device array that aliases that memory (no copy; ``aliases`` checks it).
So for CPU devices ``sharded_loader.load_sharded`` builds every param leaf here:

  * Each device's shard of each leaf (a whole ``[groups, ...]`` stack for the layer leaves)
    is one uninitialised, huge-page-advised host allocation (``host_empty``): no zero-fill,
    and first touches fault 2 MiB pages, not 4 KiB ones; a thread faults them in ahead of
    the reads (``Populator``).
  * Leaves stored in the param layout (routed experts, head, embeddings, norms) are read with
    positional reads straight into their slot (``Leaf.fill``). Leaves stored transposed (HF's
    [out, in] for a param's [in, out]) are read into one of two reused scratch buffers and
    transposed block by block into their slot (``transpose_into``) on a worker thread, while
    the main thread reads the next leaf. Further local devices holding the same bytes (the
    replicated leaves) get a copy on that thread.
  * At the end each buffer becomes its device's shard of a global array, zero-copy.

What a process reads is what ``sharded_loader`` reads (a routed-expert leaf only its devices'
experts, the rest once per process); ``LoadReport`` is filled the same way.
"""

from __future__ import annotations

import concurrent.futures
import math
import mmap
import time
from typing import Any, Callable

import jax
from jax.experimental.layout import Format
import numpy as np

from sglang_tpu_backend.model_loader.checkpoint_io import BYTES_READ

HUGE_PAGE = 2 << 20
TRANSPOSE_ROWS = 64  # rows of the source per block of transpose_into (fastest measured: 0.9 GB/s)
ROW_CHUNK_BYTES = 64 << 20  # a large transposed leaf (the head) is read in row chunks of this
POPULATE_AHEAD = True  # fault the buffers in on a thread ahead of the reads (``Populator``)


def host_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array, page-aligned (what a CPU device array may alias).
    From 2 MiB up it has its own anonymous mapping, 2 MiB-aligned and advised for transparent
    huge pages (``MADV_HUGEPAGE``, where the kernel has it); nothing is touched here, and the
    mapping goes when the last view of it does. Smaller ones come from numpy's allocator
    (a huge page each would waste most of it)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE_PAGE:
        raw = np.empty(n + mmap.PAGESIZE, np.uint8)
        off = -raw.ctypes.data % mmap.PAGESIZE
        return raw[off:off + n].view(dtype).reshape(shape)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, np.uint8)
    off = -raw.ctypes.data % HUGE_PAGE
    return raw[off:off + n].view(dtype).reshape(shape)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in as if written (zeroed pages)
POPULATE_CHUNK = 64 << 20


class Populator:
    """A thread that faults in host buffers (``MADV_POPULATE_WRITE``) in the order the load
    fills them, ahead of the reads: the kernel's page allocation and zeroing then run while
    the reading thread waits on the disk, instead of inside its reads. Stops at the end of its
    list, on ``stop()``, or where the kernel lacks the call (Linux < 5.14: ``supported`` turns
    False and the reads fault the pages)."""

    def __init__(self, bufs: list[np.ndarray]):
        import ctypes
        import threading

        self.supported = True
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bufs,), daemon=True)
        self._thread.start()

    def _run(self, bufs: list[np.ndarray]) -> None:
        for b in bufs:  # ctypes calls release the GIL: the readers run meanwhile
            base = b.ctypes.data
            lo = base - base % mmap.PAGESIZE
            for off in range(lo, base + b.nbytes, POPULATE_CHUNK):
                if self._stop.is_set():
                    return
                n = min(POPULATE_CHUNK, base + b.nbytes - off)
                if self._libc.madvise(off, n, _MADV_POPULATE_WRITE):
                    self.supported = False
                    return

    def stop(self) -> None:
        """Stop at the next chunk and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def stop_when_done(self) -> None:
        """Wait until every buffer is faulted in."""
        self._thread.join()


def transpose_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = swapaxes(src, -1, -2)`` (``src [..., a, b]``, ``dst [..., b, a]``), a block of
    ``TRANSPOSE_ROWS`` source rows at a time: numpy's whole-array strided copy ran at 0.25 GB/s
    for a 64 MiB bf16 matrix on this VM, by blocks at 0.9 GB/s. Copies raw bits (unsigned
    ints of the item size), so any dtype moves unchanged."""
    if dst.shape != (*src.shape[:-2], src.shape[-1], src.shape[-2]) or dst.dtype != src.dtype:
        raise ValueError(f"cannot transpose {src.dtype}{list(src.shape)} into "
                         f"{dst.dtype}{list(dst.shape)}")
    bits = np.dtype(f"u{src.dtype.itemsize}")
    d, s = dst.view(bits), src.view(bits)
    for i in range(0, s.shape[-2], TRANSPOSE_ROWS):
        d[..., i:i + TRANSPOSE_ROWS] = np.swapaxes(s[..., i:i + TRANSPOSE_ROWS, :], -1, -2)


def aliases(x: jax.Array, bufs: list[np.ndarray]) -> bool:
    """Whether a shard of ``x`` on a CPU device lies in the memory of one of the host arrays
    ``bufs``: CPU devices may take a host array (or a slice of one) as their buffer, without
    a copy."""
    spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in bufs]
    return any(lo <= s.data.unsafe_buffer_pointer() < hi for s in x.addressable_shards
               if s.device.platform == "cpu" for lo, hi in spans)


def sharding_of(s: Any) -> jax.sharding.Sharding:
    """The sharding of a tree leaf that is a Sharding or a layout ``Format`` (what the
    parameter shardings hold for dense weights on a TPU: sharding + device layout)."""
    return s.sharding if isinstance(s, Format) else s


def is_cpu(shardings: Any) -> bool:
    """Whether every device of every sharding in the tree (Shardings or ``Format``s) is a CPU
    device."""
    return all(d.platform == "cpu" for s in jax.tree.leaves(shardings)
               for d in sharding_of(s).device_set)


class _Scratch:
    """Two reused host buffers for leaves read before they are transposed: the main thread
    reads into one while the worker transposes out of the other."""

    def __init__(self):
        self.bufs: list[np.ndarray | None] = [None, None]
        self.busy: list[concurrent.futures.Future | None] = [None, None]
        self.k = 0

    def take(self, shape: tuple[int, ...], dtype: Any) -> tuple[int, np.ndarray]:
        k, self.k = self.k, 1 - self.k
        if self.busy[k] is not None:
            self.busy[k].result()
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if self.bufs[k] is None or self.bufs[k].nbytes < n:
            self.bufs[k] = host_empty((n,), np.uint8)
        return k, self.bufs[k][:n].view(dtype).reshape(shape)


class HostFiller:
    """Fills the host buffers of one load: reads on the calling thread, transposes and copies
    to further devices on one worker thread. ``report``: the ``LoadReport`` to account in."""

    def __init__(self, report: Any, num_experts: int):
        self.report, self.E = report, num_experts
        self.worker = concurrent.futures.ThreadPoolExecutor(1)
        self.scratch = _Scratch()
        self.pending: list[concurrent.futures.Future] = []

    def _submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        self.pending.append(self.worker.submit(fn, *args))
        return self.pending[-1]

    def _read(self, leaf: Any, out: np.ndarray, args: tuple) -> None:
        """``out`` := the leaf in the param layout; its read counted in ``read_seconds``.
        Straight into ``out`` when the leaf is stored that way, else through a scratch
        buffer and a transpose (or copy) on the worker."""
        t0 = time.perf_counter()
        if not leaf.swapped and out.flags.c_contiguous:
            leaf.fill(out, *args)
            self.report.read_seconds += time.perf_counter() - t0
            return
        shape = (*out.shape[:-2], out.shape[-1], out.shape[-2]) if leaf.swapped else out.shape
        k, tmp = self.scratch.take(shape, out.dtype)
        leaf.fill(tmp, *args)
        self.report.read_seconds += time.perf_counter() - t0
        self.scratch.busy[k] = self._submit(transpose_into if leaf.swapped else np.copyto, out, tmp)

    def fill(self, leaf: Any, targets: list[tuple[Any, tuple[slice, ...], np.ndarray]],
             shape: tuple[int, ...], args: tuple = ()) -> None:
        """Fill ``targets`` (device, its index into the leaf of param ``shape``, its buffer
        for that index) with one leaf (``leaf.read(*args)``, a routed-expert leaf's expert
        range first). A routed-expert leaf is read once per expert range (bytes charged to
        the first device holding it), any other once, into the first device holding it whole;
        the other devices copy. A device holding part of another axis copies its part out
        of one read of the whole leaf."""
        def full(idx: tuple[slice, ...], start: int) -> bool:
            return all(sl.indices(n) == (0, n, 1) for sl, n in zip(idx[start:], shape[start:]))

        first: dict[Any, np.ndarray] = {}  # expert range (None: the whole leaf) -> its buffer
        whole = None
        for d, idx, out in targets:
            if full(idx, 1 if leaf.experts else 0):
                key = idx[0].indices(self.E)[:2] if leaf.experts else None
                if key in first:
                    self._submit(np.copyto, out, first[key])
                    continue
                before = BYTES_READ.bytes
                self._read(leaf, out, (*key, *args) if leaf.experts else args)
                first[key] = out
                if leaf.experts:
                    self.report.expert_ranges[d.id] = key
                    self.report.expert_bytes[d.id] = (self.report.expert_bytes.get(d.id, 0)
                                                      + BYTES_READ.bytes - before)
                continue
            if whole is None:
                whole = np.empty(shape, out.dtype)
                self._read(leaf, whole, (0, self.E, *args) if leaf.experts else args)
            self._submit(np.copyto, out, whole[idx])

    def finish(self) -> None:
        """Wait for every transpose and copy, re-raising the first error (any of them, not
        only the last one's); stop the worker."""
        try:
            for f in self.pending:
                f.result()
        finally:
            self.pending.clear()
            self.worker.shutdown(wait=True)


class HostLeaf:
    """One param leaf's host buffers, one per local device holding part of it.

    ``shape``/``sharding``: the global param; ``stacked``: a ``[groups, ...]`` leaf filled
    slot by slot (``targets(g)``), else filled whole (``targets()``)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, sharding: Any, stacked: bool):
        self.shape, self.sharding, self.stacked = tuple(shape), sharding, stacked
        self.index = sharding.addressable_devices_indices_map(self.shape)
        if stacked and any(idx[0].indices(self.shape[0]) != (0, self.shape[0], 1)
                           for idx in self.index.values()):
            raise ValueError(f"a stacked leaf {list(self.shape)} split on its groups axis")
        self.bufs = {d: host_empty(tuple(len(range(*sl.indices(n)))
                                         for sl, n in zip(idx, self.shape)), dtype)
                     for d, idx in self.index.items()}

    def targets(self, region: tuple = ()) -> list[tuple[Any, tuple[slice, ...], np.ndarray]]:
        """(device, index into the filled leaf, buffer) per device, for ``HostFiller.fill``:
        ``region`` of each buffer (``(g,)``: slot g of a stacked leaf; a tuple of slices: a
        chunk of a leaf every device holds whole, indexed relative to the chunk)."""
        out = []
        for d, idx in self.index.items():
            view = self.bufs[d][region]
            if self.stacked:
                idx = idx[1:]
            elif region:
                idx = (slice(None),) * view.ndim
            out.append((d, idx, view))
        return out

    def array(self) -> jax.Array:
        """The global array, each device's shard its buffer (zero-copy on CPU)."""
        shards = [jax.device_put(self.bufs[d], d) for d in self.index]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, shards)
