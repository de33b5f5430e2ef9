"""Weights straight into their shardings: a checkpoint read shard by shard, or dummy weights.

``load_sharded(dir, cfg, shardings)`` builds the placed params tree (layout in
``models/qwen3_5_moe.py``; ``shardings`` mirrors ``param_shapes(cfg)``) with no full host copy:

  * The top-level leaves, then layer by layer in file order, leaf by leaf: the leaf as
    stored (see ``loader.Leaf``) is read on the host, each local device's share of it: a
    routed-expert leaf ``[E, ...]`` split on E is read once per expert range that local
    devices hold, only those experts (their tensors in the per-expert layout, their rows of
    the fused one, FP8 scales with their weights); any other leaf is read once per process.
    The embeddings and the head go in row chunks of ``CHUNK_BYTES``.
  * The reads run ahead on a few threads (``read_ahead.py``: ``WORKERS`` threads, in load
    order; read and not yet placed at most this process's share of the largest layer, and
    at most ``AHEAD_BYTES``) while the main thread places the current leaf:
    ``jax.make_array_from_callback`` with the leaf's sharding less the stacked axis hands
    each local device its shard of the arrays read for it. The reads land in recycled host
    buffers (``host_pool.py``: by shape and dtype, as consecutive layers repeat them), each
    returned to the pool once the devices have its leaf.
  * The devices then write it into its slot of the stacked ``[groups, ...]`` buffer, which
    was allocated on the devices and is donated to every write: a plain copy for the routed
    experts and the head, whose param layout is the checkpoint's [out, in]; a transpose for
    the other weights (HF's [out, in] into the param's [in, out]). Up to ``IN_FLIGHT``
    leaves (``$STB_LOAD_IN_FLIGHT`` where set) are in flight: the main thread places a leaf
    while the previous ones' transfers and writes run, and waits for the write of the leaf
    that many steps back before taking the next one (then returning its host buffers). The
    host holds those leaves and what is read ahead (this process's share of each); the pool
    keeps buffers for reuse only within that bound. The zeroing and write programs are
    compiled on threads while the first leaves are read (``load_programs.py``), not one by
    one at their first call; the stacks are zeroed when the first layer's leaf is written.
  * Meanwhile a thread asks the kernel to read the layer after the one being read into the
    page cache.

That is the path for accelerators. Where every device is a CPU device (their memory is host
memory) the same reads go straight into host buffers that then become the devices' buffers
without a copy, with no zero-fill and no device-side write (``host_load.py``).

Files are read with positional reads of just the bytes wanted (``checkpoint_io.read_rows``);
``LoadReport`` has the bytes this process read, which experts each local device holds, and
how long reading took. An error reading a tensor (``CheckpointError`` for a short or failed
read) is raised in the caller's thread as raised, the reading threads stopped.

``dummy_init(cfg, ...)``: random weights of the config's shapes (``--load-format dummy``),
drawn by one jitted program whose outputs are placed by ``shardings``, so each device
generates its own shard. The function is traceable: ``jax.eval_shape`` / ``.lower()`` check
it at any size without materialising a weight.

``WeightSource`` is what the engine hands its runner: the config, the path and the format.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm.auto import tqdm

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.weight_layout import uses_native_layouts, weight_formats
from sglang_tpu_backend.model_loader import host_load, host_pool, load_programs, read_ahead
from sglang_tpu_backend.model_loader.checkpoint_io import BYTES_READ
from sglang_tpu_backend.model_loader.loader import (
    CheckpointLeaves, Leaf, load_params, resolve_keep_fp8)
from sglang_tpu_backend.models.param_shapes import param_shapes
from sglang_tpu_backend.server_args import LOAD_FORMATS

CHUNK_BYTES = 256 << 20  # large replicated leaves (embeddings, head) are placed in chunks of this
IN_FLIGHT = 2  # leaves placed whose writes may still run when the main thread places the next


def in_flight() -> int:
    """Leaves in flight for a load: ``$STB_LOAD_IN_FLIGHT`` where set (experiments), else
    ``IN_FLIGHT``; read at each load. Raises ValueError below 1."""
    n = int(os.environ.get("STB_LOAD_IN_FLIGHT") or IN_FLIGHT)
    if n < 1:
        raise ValueError(f"STB_LOAD_IN_FLIGHT must be at least 1, got {n}")
    return n


@dataclasses.dataclass
class LoadReport:
    """What one process did to load the weights.

    bytes_read: checkpoint tensor bytes this process read (0 for dummy weights).
    expert_ranges: local device id -> the routed experts ``(lo, hi)`` it holds.
    expert_bytes: local device id -> routed-expert bytes read for it.
    seconds: wall time of the load.
    read_seconds: of which the main thread spent reading and assembling leaves on the host
      (CPU devices), or waiting for the read-ahead's leaves (accelerators: the reading not
      hidden behind placing); the rest: placing leaves on the devices, and the devices'
      transposes and writes into the stacks.
    reader_seconds: the time spent reading and assembling leaves on the host, summed over
      the threads doing it (on accelerators the read-ahead's, which overlap each other and
      the placing; on CPU devices the main thread's, = read_seconds).
    phases: accelerators: the main thread's seconds by phase ("stacks": compiling and
      zeroing the stacked buffers, at the first layer's leaf, after the top-level leaves;
      "read": waiting for the read-ahead (= read_seconds); "written": waiting for the write
      of the leaf ``in_flight()`` steps back (its host-to-device transfer included); "place":
      handing a leaf to the devices; "compile": waiting for a write program; "write":
      dispatching the writes; "final": waiting for the last writes).
    host_buffers: accelerators: the host buffer pool's counts (``host_pool.HostPool``:
      "recycled" reads into a returned buffer, "fresh" allocations, "evicted" buffers).
    """

    bytes_read: int = 0
    expert_ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    expert_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    read_seconds: float = 0.0
    reader_seconds: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    host_buffers: dict[str, int] = dataclasses.field(default_factory=dict)

    def timed(self, phase: str, t0: float) -> float:
        """Charge the seconds since ``t0`` to ``phase``; returns now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - t0
        return now


def with_native_layouts(shapes: Any, shardings: Any) -> Any:
    """``shardings`` with the TPU-native formats of dense weights (``weight_layout.py``) when
    they are on a TPU; unchanged elsewhere."""
    leaves = jax.tree.leaves(shardings)
    if leaves and uses_native_layouts(leaves[0]):
        return weight_formats(shapes, shardings)
    return shardings


def _as_read(leaf: Leaf, s: jax.ShapeDtypeStruct, sharding: Any, *, stacked: bool
             ) -> tuple[tuple[int, ...], Any]:
    """Shape and sharding of what ``leaf.read`` returns for a param of shape ``s`` placed by
    ``sharding``: one layer's slice of a ``stacked`` [groups, ...] leaf, its last two axes
    swapped when the leaf is read that way."""
    shape, sharding = s.shape[1:] if stacked else s.shape, host_load.sharding_of(sharding)
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (len(s.shape) - len(sharding.spec))
        spec = spec[1:] if stacked else spec
        if leaf.swapped:
            spec[-2:] = spec[-1], spec[-2]
        while spec and spec[-1] is None:  # P(None,) != P(): the form place_params gives
            spec.pop()
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    if leaf.swapped:
        shape = (*shape[:-2], shape[-1], shape[-2])
    return shape, sharding


@dataclasses.dataclass(frozen=True)
class _Step:
    """One leaf (or row chunk of one) of the accelerator path, in load order: ``leaf`` read as
    ``shape`` placed by ``as_read``, then written into param ``key`` (a top-level name, or
    ``(j, k, g)``: stack j's leaf k, slot g) of shape ``s`` placed by ``sharding``; ``lo``: a
    row chunk's first row (None: the whole leaf); ``ranges``: a routed-expert leaf's expert
    ranges ``(lo, hi)`` that local devices hold, each read once; ``layer``: -1 at the top."""

    leaf: Leaf
    shape: tuple[int, ...]
    as_read: Any
    key: Any
    s: jax.ShapeDtypeStruct
    sharding: Any
    lo: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    layer: int = -1


def _step(leaf: Leaf, s: jax.ShapeDtypeStruct, sharding: Any, key: Any, num_experts: int, *,
          stacked: bool, layer: int = -1) -> _Step:
    """The step placing ``leaf`` into param ``key`` (shape ``s``, placed by ``sharding``)."""
    shape, as_read = _as_read(leaf, s, sharding, stacked=stacked)
    ranges = () if not leaf.experts else tuple(sorted(
        {idx[0].indices(num_experts)[:2]
         for idx in host_load.sharding_of(as_read).addressable_devices_indices_map(shape).values()}))
    return _Step(leaf, shape, as_read, key, s, sharding, ranges=ranges, layer=layer)


def _chunk(leaf: Leaf, lo: int, hi: int) -> Leaf:
    """Rows ``lo:hi`` of a ``rows`` leaf as a leaf of its own (read whole: ``read()``,
    ``into(out)``)."""
    into = None if leaf.into is None else (lambda out: leaf.into(out, lo, hi))
    return Leaf(functools.partial(leaf.read, lo, hi), into=into)


def _plan(leaves: CheckpointLeaves, cfg: ModelConfig, shapes: Any, shardings: Any) -> list[_Step]:
    """The accelerator path's steps in load order: the top-level leaves (a large one every
    local device holds whole in row chunks of ``CHUNK_BYTES``), then layer by layer, leaf by
    leaf."""
    steps, E = [], cfg.num_experts
    for k, leaf in leaves.top().items():
        s, sh = shapes[k], shardings[k]
        st = _step(leaf, s, sh, k, E, stacked=False)
        if not (leaf.rows and host_load.sharding_of(sh).is_fully_replicated):
            steps.append(st)
            continue
        step = max(1, CHUNK_BYTES // (s.size // st.shape[0] * s.dtype.itemsize))
        for lo in range(0, st.shape[0], step):
            hi = min(st.shape[0], lo + step)
            steps.append(dataclasses.replace(st, leaf=_chunk(leaf, lo, hi),
                                             shape=(hi - lo, *st.shape[1:]), lo=lo))
    groups = [jax.tree.flatten(g)[0] for g in shapes["layer_groups"]]
    group_shardings = [jax.tree.leaves(sh) for sh in shardings["layer_groups"]]
    P = cfg.layer_period
    for i in range(cfg.num_hidden_layers):
        j, g = i % P, i // P
        for k, leaf in enumerate(jax.tree.leaves(leaves.layer(i))):
            steps.append(_step(leaf, groups[j][k], group_shardings[j][k], (j, k, g), E,
                               stacked=True, layer=i))
    return steps


def _job_bytes(st: _Step) -> list[int]:
    """The bytes of each read of one step (what ``_reads(st)``'s jobs return): the whole
    leaf, or each expert range's rows."""
    nbytes = math.prod(st.shape) * st.s.dtype.itemsize
    if not st.ranges:
        return [nbytes]
    return [nbytes // st.shape[0] * (hi - lo) for lo, hi in st.ranges]


def _reads(st: _Step, pool: host_pool.HostPool | None) -> list[tuple[int, Any]]:
    """The read-ahead's jobs for one step, ``(bytes, read)`` (``read_ahead.py``): the whole
    leaf (``st.shape``), or each expert range's rows (``[hi - lo, *st.shape[1:]]``) with the
    file bytes read for them; into buffers from ``pool`` where the leaf can fill one."""
    dtype = st.s.dtype
    if not st.ranges:
        return [(_job_bytes(st)[0],
                 functools.partial(host_pool.leaf_read, pool, st.leaf, st.shape, dtype))]

    def rows(lo: int, hi: int) -> tuple[np.ndarray, int]:
        before = BYTES_READ.thread_bytes
        out = host_pool.leaf_read(pool, st.leaf, (hi - lo, *st.shape[1:]), dtype, lo, hi)
        return out, BYTES_READ.thread_bytes - before

    return [(n, functools.partial(rows, lo, hi)) for n, (lo, hi) in zip(_job_bytes(st), st.ranges)]


def _place_leaf(st: _Step, host: list, num_experts: int, report: LoadReport) -> jax.Array:
    """One step's leaf as a global array, each local device's shard cut from ``host``, what
    ``_reads(st)`` read: the whole leaf (handed to every local device), or a routed-expert
    leaf's rows of each expert range (expert bytes charged to the first device holding it)."""
    devices = host_load.sharding_of(st.as_read).addressable_devices_indices_map(st.shape)
    got = dict(zip(st.ranges, host))
    for lo_hi, (_, nbytes) in got.items():
        d = next(d for d, idx in devices.items() if idx[0].indices(num_experts)[:2] == lo_hi)
        report.expert_ranges[d.id] = lo_hi
        report.expert_bytes[d.id] = report.expert_bytes.get(d.id, 0) + nbytes

    def shard(idx: tuple[slice, ...]) -> np.ndarray:
        if not st.ranges:
            return host[0][idx]
        rows = got[idx[0].indices(num_experts)[:2]][0]
        return rows[(slice(None), *idx[1:])]

    return jax.make_array_from_callback(st.shape, st.as_read, shard)


def _local_expert_ranges(shapes: Any, shardings: Any, num_experts: int) -> list[tuple[int, int]]:
    """The expert ranges ``(lo, hi)`` this process's devices hold."""
    found = set()
    for (path, s), sh in zip(jax.tree_util.tree_flatten_with_path(shapes)[0],
                             jax.tree.leaves(shardings)):
        if any(getattr(k, "key", None) == "experts" for k in path):
            for idx in host_load.sharding_of(sh).addressable_devices_indices_map(s.shape).values():
                found.add(idx[1].indices(num_experts)[:2])  # [groups, E, ...]
            break
    return sorted(found)


def _load_on_host(leaves: CheckpointLeaves, cfg: ModelConfig, shapes: Any, shardings: Any,
                  report: LoadReport, progress: bool | None, before_layer) -> Any:
    """``load_sharded`` for CPU devices: every leaf read into host buffers that become the
    devices' buffers (``host_load.py``). ``before_layer(i)`` runs before layer i is read."""
    top = leaves.top()
    params = {k: host_load.HostLeaf(shapes[k].shape, shapes[k].dtype, host_load.sharding_of(shardings[k]),
                                    stacked=False) for k in top}
    groups = [jax.tree.flatten(g) for g in shapes["layer_groups"]]
    group_shardings = [jax.tree.leaves(sh) for sh in shardings["layer_groups"]]
    stacks = [[host_load.HostLeaf(s.shape, s.dtype, host_load.sharding_of(sh), stacked=True)
               for s, sh in zip(g[0], shs)] for g, shs in zip(groups, group_shardings)]
    P = cfg.layer_period
    order = [b for hl in params.values() for b in hl.bufs.values()]  # as filled, slot by slot
    order += [b[i // P] for i in range(cfg.num_hidden_layers) for hl in stacks[i % P]
              for b in hl.bufs.values()]
    populator = host_load.Populator(order) if host_load.POPULATE_AHEAD else None
    filler = host_load.HostFiller(report, cfg.num_experts)
    try:
        for k, leaf in top.items():
            s, sh, hl = shapes[k], host_load.sharding_of(shardings[k]), params[k]
            if leaf.rows and sh.is_fully_replicated:  # in row chunks (columns when swapped)
                rows = s.shape[-1] if leaf.swapped else s.shape[0]
                step = max(1, host_load.ROW_CHUNK_BYTES // (s.size // rows * s.dtype.itemsize))
                for lo in range(0, rows, step):
                    hi = min(rows, lo + step)
                    region = (slice(None), slice(lo, hi)) if leaf.swapped else (slice(lo, hi),)
                    targets = hl.targets(region)
                    filler.fill(leaf, targets, targets[0][2].shape, (lo, hi))
            else:
                filler.fill(leaf, hl.targets(), tuple(s.shape))
        disable = None if progress is None else not progress
        for i in tqdm(range(cfg.num_hidden_layers), desc="loading weights", unit="layer",
                      disable=disable):
            before_layer(i)
            j, g = i % P, i // P
            for k, leaf in enumerate(jax.tree.leaves(leaves.layer(i))):
                hl = stacks[j][k]
                filler.fill(leaf, hl.targets((g,)), hl.shape[1:])
    finally:
        filler.finish()
        if populator is not None:
            populator.stop()
    params = {k: hl.array() for k, hl in params.items()}
    params["layer_groups"] = tuple(
        jax.tree.unflatten(treedef, [hl.array() for hl in st])
        for (_, treedef), st in zip(groups, stacks))
    return params


def _ahead_bytes(steps: list[_Step]) -> int:
    """The read-ahead's bound: about one layer, this process's share of the largest one (what
    its reads return), and at most ``read_ahead.AHEAD_BYTES``."""
    layer_bytes: dict[int, int] = {}
    for st in steps:
        if st.layer >= 0:
            layer_bytes[st.layer] = layer_bytes.get(st.layer, 0) + sum(_job_bytes(st))
    return min(read_ahead.AHEAD_BYTES, max(layer_bytes.values(), default=read_ahead.AHEAD_BYTES))


def _pool_bytes(steps: list[_Step], ahead: int, flying: int) -> int:
    """The host buffer pool's cap in bytes: what the main thread may hold without one, what
    is read ahead (``ahead``, or one read alone when larger) plus ``flying`` steps taken and
    not yet known written (``in_flight()``), each at most the largest step's bytes."""
    largest = max((sum(_job_bytes(st)) for st in steps), default=0)
    return max(ahead, largest) + flying * largest


def _programs(st: _Step) -> list[tuple[Any, Any]]:
    """``(key, lowering)`` of the device programs ``_write`` runs for ``st`` (none when the
    placed leaf is the param itself)."""
    if st.layer >= 0:
        kind = "slot"
    elif st.lo is not None or st.leaf.swapped:
        kind = "rows"
    else:
        return []
    out = [load_programs.write_program(kind, st.s, st.sharding, st.shape, st.as_read,
                                       st.leaf.swapped)]
    if st.layer < 0:  # a zeroed buffer first
        out.insert(0, load_programs.zeros_program(st.s, st.sharding))
    return out


def _write(st: _Step, x: jax.Array, params: dict, stacks: list[list[jax.Array]]) -> jax.Array:
    """Write one step's placed leaf into its param: slot g of a stack, rows of a top-level
    leaf (zeroed before its first chunk), or the whole of one (transposed when read swapped).
    Returns the param as written (dispatched, maybe not done)."""
    zeros, writer = load_programs.zeros, load_programs.writer
    if st.layer >= 0:
        j, k, g = st.key
        stacks[j][k] = writer("slot", st.sharding)(stacks[j][k], x, np.int32(g), st.leaf.swapped)
        return stacks[j][k]
    if st.lo is not None:
        buf = params[st.key] if st.lo else zeros(st.s, st.sharding)
        params[st.key] = writer("rows", st.sharding)(buf, x, np.int32(st.lo), st.leaf.swapped)
    elif st.leaf.swapped:
        params[st.key] = writer("rows", st.sharding)(zeros(st.s, st.sharding), x, np.int32(0), True)
    else:
        params[st.key] = x
    return params[st.key]


def _load_on_devices(leaves: CheckpointLeaves, cfg: ModelConfig, shapes: Any, shardings: Any,
                     report: LoadReport, progress: bool | None, prefetch) -> Any:
    """``load_sharded`` for accelerators: the steps of ``_plan`` read ahead on threads
    (``read_ahead.py``) into pooled host buffers (``host_pool.py``) while the main thread
    places and writes each in turn, taking each once the write ``in_flight()`` steps back is
    done (and that step's buffers are back in the pool), so the host holds what is read
    ahead and that many leaves. ``prefetch(i)`` runs when the reads of layer i - 1 are
    queued."""
    steps, flying = _plan(leaves, cfg, shapes, shardings), in_flight()
    ahead_bytes = _ahead_bytes(steps)
    pool = host_pool.HostPool(_pool_bytes(steps, ahead_bytes, flying))
    reads = [_reads(st, pool) for st in steps]

    def jobs():
        for n, (st, r) in enumerate(zip(steps, reads)):
            if st.layer >= 0 and (n == 0 or steps[n - 1].layer != st.layer):
                prefetch(st.layer + 1)
            yield from r

    groups = [jax.tree.flatten(g)[0] for g in shapes["layer_groups"]]
    group_shardings = [jax.tree.leaves(sh) for sh in shardings["layer_groups"]]
    stack_zeros = [load_programs.zeros_program(s, sh)
                   for g in zip(groups, group_shardings) for s, sh in zip(*g)]
    programs = [_programs(st) for st in steps]
    compiler = load_programs.Precompiler()
    for key, lower in stack_zeros + [p for ps in programs for p in ps]:
        compiler.submit(key, lower)
    ahead = read_ahead.ReadAhead(jobs(), max_bytes=ahead_bytes)
    t, stacks = time.perf_counter(), None

    def zeroed_stacks() -> list[list[jax.Array]]:
        """The stacked [groups, ...] buffers, zeroed at the first layer's step (the top-level
        leaves before it are placed while their programs compile)."""
        for key, _ in stack_zeros:
            compiler.wait(key)
        return [[load_programs.zeros(s, sh) for s, sh in zip(*g)]
                for g in zip(groups, group_shardings)]

    try:
        params: dict = {}
        disable = None if progress is None else not progress
        with tqdm(total=cfg.num_hidden_layers, desc="loading weights", unit="layer",
                  disable=disable) as bar:
            flight: collections.deque = collections.deque()  # (param as written, x, bufs)
            for n, st in enumerate(steps):
                while len(flight) >= flying:  # step n - flying written: its host
                    host_pool.retire(*flight.popleft(), pool)  # arrays back in the pool
                t = report.timed("written", t)
                host = [ahead.take() for _ in st.ranges or (None,)]
                t = report.timed("read", t)
                x = _place_leaf(st, host, cfg.num_experts, report)
                bufs = [h[0] for h in host] if st.ranges else host
                del host
                t = report.timed("place", t)
                for key, _ in programs[n]:
                    compiler.wait(key)
                t = report.timed("compile", t)
                if stacks is None and st.layer >= 0:
                    stacks = zeroed_stacks()
                    t = report.timed("stacks", t)
                flight.append((_write(st, x, params, stacks), x, bufs))
                del x, bufs
                t = report.timed("write", t)
                if st.layer >= 0 and (n + 1 == len(steps) or steps[n + 1].layer != st.layer):
                    bar.update(1)
    finally:
        ahead.close()
        compiler.close()
        report.read_seconds, report.reader_seconds = ahead.wait_seconds, ahead.reader_seconds
        report.host_buffers = pool.counts()
    params["layer_groups"] = tuple(jax.tree.unflatten(jax.tree.structure(s), st)
                                   for s, st in zip(shapes["layer_groups"],
                                                    stacks or zeroed_stacks()))
    params = jax.block_until_ready(params)
    report.timed("final", t)
    return params


def load_sharded(checkpoint_dir: str | Path, cfg: ModelConfig, shardings: Any, *,
                 dtype: Any = jnp.bfloat16, keep_fp8_experts: bool = False,
                 backend: str | None = None, progress: bool | None = None,
                 host_buffers: bool | None = None) -> tuple[Any, LoadReport]:
    """The checkpoint's params placed by ``shardings`` (a mirror of ``param_shapes``), every
    process reading only what its devices hold; see the module docstring. ``dtype``,
    ``keep_fp8_experts``, ``backend``: as for ``loader.load_params``, whose params these equal.
    ``host_buffers``: read into host buffers the devices then use as theirs (``host_load.py``;
    only right where the devices' memory is host memory); None: exactly when every device is
    a CPU device. Raises CheckpointError before reading any data when a tensor is missing or
    misshapen; an error reading a tensor is raised as it was raised, every reading thread
    stopped."""
    t0, bytes0 = time.perf_counter(), BYTES_READ.bytes
    keep_fp8 = resolve_keep_fp8(keep_fp8_experts, backend)
    leaves = CheckpointLeaves(checkpoint_dir, cfg, dtype=dtype, keep_fp8_experts=keep_fp8)
    shapes = param_shapes(cfg, dtype, fp8_experts=keep_fp8)
    shardings = with_native_layouts(shapes, shardings)
    report = LoadReport()
    experts = _local_expert_ranges(shapes, shardings, cfg.num_experts)
    ahead = concurrent.futures.ThreadPoolExecutor(1)  # page-cache read-ahead of the next layer
    ahead.submit(leaves.prefetch, -1, experts)
    ahead.submit(leaves.prefetch, 0, experts)
    if host_buffers is None:
        host_buffers = host_load.is_cpu(shardings)
    if host_buffers:
        params = _load_on_host(leaves, cfg, shapes, shardings, report, progress,
                               lambda i: ahead.submit(leaves.prefetch, i + 1, experts))
        ahead.shutdown(wait=False, cancel_futures=True)
        report.reader_seconds = report.read_seconds  # read on the main thread
        report.bytes_read, report.seconds = BYTES_READ.bytes - bytes0, time.perf_counter() - t0
        return params, report
    try:
        params = _load_on_devices(leaves, cfg, shapes, shardings, report, progress,
                                  lambda i: ahead.submit(leaves.prefetch, i, experts))
    finally:
        ahead.shutdown(wait=True, cancel_futures=True)
    report.bytes_read, report.seconds = BYTES_READ.bytes - bytes0, time.perf_counter() - t0
    return params, report


# Dummy weights --------------------------------------------------------------------------
_STD = {"gate": 0.1, "conv1d": 0.3}  # routers decisive, conv taps of a 4-wide kernel
_WEIGHT_STD, _NORM_STD, _FP8_SCALE = 0.02, 0.05, 0.02


def _dummy_leaf(key: jax.Array, path: tuple, s: jax.ShapeDtypeStruct) -> jax.Array:
    """Random values for one leaf, by its name: zero-centred (1 + w) norms, GDN's plain gated
    norm around 1, A in [1, 16), dt in [1e-3, 1e-1), FP8 experts N(0, 1) with scale 0.02."""
    name = getattr(path[-1], "key", "")
    parent = getattr(path[-2], "key", "") if len(path) > 1 else ""
    if name == "A_log":
        return jnp.log(jax.random.uniform(key, s.shape, jnp.float32, 1.0, 16.0))
    if name == "dt_bias":
        return jnp.log(jnp.expm1(jax.random.uniform(key, s.shape, jnp.float32, 1e-3, 1e-1)))
    if name.endswith("_scale"):
        return jnp.full(s.shape, _FP8_SCALE, s.dtype)
    x = jax.random.normal(key, s.shape, jnp.float32)
    if s.dtype == jnp.float8_e4m3fn:
        return x.astype(s.dtype)
    if name.endswith("norm") or name.endswith("layernorm"):
        x = x * _NORM_STD + (1.0 if parent == "linear_attn" else 0.0)
    else:
        x = x * _STD.get(name, _WEIGHT_STD)
    return x.astype(s.dtype)


def dummy_init(cfg: ModelConfig, *, dtype: Any = jnp.bfloat16, fp8_experts: bool = False):
    """A function of the seed (an int32 scalar, traceable) returning random params of
    ``param_shapes(cfg, dtype, fp8_experts)``; leaf k draws from ``fold_in(key(seed), k)``.
    Jit it with ``out_shardings`` to generate each device's shard on the device."""
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8_experts)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def init(seed):
        key = jax.random.key(seed)
        return jax.tree_util.tree_unflatten(
            treedef, [_dummy_leaf(jax.random.fold_in(key, k), path, s)
                      for k, (path, s) in enumerate(flat)])

    return init


_DUMMY_PROGRAMS: dict = {}  # one jitted generator per (config, dtype, experts, placement)


def dummy_params(cfg: ModelConfig, shardings: Any, *, dtype: Any = jnp.bfloat16,
                 fp8_experts: bool = False, seed: int = 0) -> Any:
    """``dummy_init``'s params generated on the devices, placed by ``shardings``."""
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8_experts)
    shardings = with_native_layouts(shapes, shardings)
    flat, treedef = jax.tree.flatten(shardings)
    key = (repr(cfg), jnp.dtype(dtype).name, fp8_experts, treedef, tuple(flat))
    if key not in _DUMMY_PROGRAMS:
        init = dummy_init(cfg, dtype=dtype, fp8_experts=fp8_experts)
        _DUMMY_PROGRAMS[key] = jax.jit(init, out_shardings=shardings)
    return _DUMMY_PROGRAMS[key](np.int32(seed))


# What a runner loads ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightSource:
    """A runner's weights: ``model_path``'s safetensors (``load_format`` auto/safetensors)
    or random weights of ``cfg``'s shapes drawn from ``seed`` (dummy), all in ``dtype``."""

    cfg: ModelConfig
    model_path: str | None
    load_format: str = "auto"
    dtype: Any = jnp.bfloat16
    seed: int = 0

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {self.load_format!r}")

    @property
    def dummy(self) -> bool:
        return self.load_format == "dummy"

    def shapes(self) -> Any:
        """The params' shapes and dtypes (ShapeDtypeStruct tree)."""
        return param_shapes(self.cfg, self.dtype)

    def load(self, shardings: Any) -> tuple[Any, LoadReport]:
        """The params placed by ``shardings`` (a mirror of ``shapes()``), read shard by shard."""
        if self.dummy:
            t0 = time.perf_counter()
            params = jax.block_until_ready(dummy_params(self.cfg, shardings, dtype=self.dtype,
                                                        seed=self.seed))
            return params, LoadReport(seconds=time.perf_counter() - t0)
        return load_sharded(self.model_path, self.cfg, shardings, dtype=self.dtype)

    def host(self) -> tuple[Any, LoadReport]:
        """The whole params on the default device (for layouts made from the whole tree)."""
        if self.dummy:
            where = SingleDeviceSharding(jax.devices()[0])
            return self.load(jax.tree.map(lambda _: where, self.shapes()))
        t0, bytes0 = time.perf_counter(), BYTES_READ.bytes
        params = load_params(self.model_path, self.cfg, dtype=self.dtype)
        return params, LoadReport(bytes_read=BYTES_READ.bytes - bytes0,
                                  seconds=time.perf_counter() - t0)
