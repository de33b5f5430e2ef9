"""Multi-process (multi-host) execution of the DP x EP step.

Several processes (one per TPU host; CPU processes in the tests) form one JAX mesh and run the
same ``DPForward`` step on it. Every process calls :func:`initialize` before touching JAX,
loads its devices' share of the same parameters (``model_loader/sharded_loader.py``:
replicated weights whole, routed experts only its own), and builds the same ``DPForward`` over the global mesh
(``make_mesh(dp_size)`` over ``jax.devices()``, which lists every process's devices).

Step protocol (leader = process 0; every call below is a collective all processes make):

  leader                                     followers
  ------                                     ---------
  batches = schedule(...)  # D rank batches
  broadcast_step(batches)   --- header --->  broadcast_step(None)
                            --- payload -->    -> the same D batches
  run_step(dp, params, cache, batches)       run_step(dp, params, cache, batches)
    -> (logits [D*L, V] numpy on every process; only the leader samples)
  ... next step: the leader's greedy choices feed the next batches ...
  broadcast_step(None)      --- stop ----->  broadcast_step(None) -> None: leave the loop

Every message is a fixed-shape ``int32[5 + D]`` header broadcast with
``multihost_utils.broadcast_one_to_all``, then (unless empty) one flat ``int32`` payload whose
size follows from the header, so a follower can allocate it. A step's header is
``(Op.STEP, T, R, P, L, mode_0..mode_{D-1})`` and its payload the D ranks' batch fields. No
sockets or pickle: both go through JAX collectives on the mesh's devices (gloo on CPU,
ICI/DCN on TPU).

Besides steps the leader sends commands (header ``(op, n, 0, ...)``, payload n ints), each
announcing a program over the mesh that every process then runs (``FollowerOps``):
  SNAPSHOT_LOAD / SNAPSHOT_SAVE  (rank, src, dst) triples: the prefix cache's GDN snapshot
                                 copies (``state_snapshots.GDNSnapshots``), before / after
                                 the step that needs them;
  EXPORT / INSTALL               (rank, slot, pages...): a handover's read of one request's
                                 state, or its write (``state_transfer.StateTransfer``); the
                                 bytes then move between the process that owns the rank and
                                 the leader in one more broadcast (none when the leader owns
                                 the rank);
  SNAPSHOT_WARM_UP / TRANSFER_WARM_UP  the leader's warm-up of those programs.
The leader's scheduler owns the prefix tree and the handover bookkeeping; followers only
repeat the copies.

Placement: ``sharded_loader.load_sharded`` / ``DPForward.init_cache`` / ``put_batch`` build
global arrays with ``jax.make_array_from_callback``, each process supplying only its own
devices' shards (the weights it read for them, the batches it received), so the same calls
serve one process and several.
"""

from __future__ import annotations

import enum
import logging
import re
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.parallel.dp_forward import DPForward

__all__ = [
    "Op", "initialize", "shutdown", "is_leader", "gather_logits", "broadcast_step", "send_command",
    "receive", "run_step", "step", "FollowerOps", "follower_loop", "broadcast_ints", "share_from",
]

# Batch fields in payload order (all int32) and their per-rank shapes from (T, R, P, L).
logger = logging.getLogger(__name__)

_FIELDS = ("input_ids", "positions", "cu_q_lens", "kv_lens", "page_table", "state_slots",
           "num_seqs", "logits_indices")
_HEADER = 5  # op, T, R, P, L (then one mode per rank); commands: op, n, 0, 0, 0, ...


class Op(enum.IntEnum):
    """What a message from the leader asks every process to do (module docstring)."""

    STEP = 0
    STOP = 1
    SNAPSHOT_LOAD = 2
    SNAPSHOT_SAVE = 3
    SNAPSHOT_WARM_UP = 4
    EXPORT = 5
    INSTALL = 6
    TRANSFER_WARM_UP = 7


def _field_shapes(T: int, R: int, P: int, L: int) -> dict[str, tuple[int, ...]]:
    return {"input_ids": (T,), "positions": (T,), "cu_q_lens": (R + 1,), "kv_lens": (R,),
            "page_table": (R, P), "state_slots": (R,), "num_seqs": (1,), "logits_indices": (L,)}


# Distributed init ---------------------------------------------------------------------------
def initialize(coordinator: str, num_processes: int, process_id: int, *, cpu_collectives: bool,
               initialization_timeout: int = 120, heartbeat_timeout: int = 60) -> None:
    """Join the JAX distributed system as ``process_id`` of ``num_processes``.

    Must run before anything else touches JAX devices. ``coordinator`` is ``host:port`` of
    process 0's coordination service (process 0 starts it). ``cpu_collectives`` selects gloo
    for cross-process collectives of the CPU backend (CPU stand-ins for hosts); TPU hosts pass
    False. Raises ValueError for bad arguments and RuntimeError when joining fails (with the
    coordinator and process named), instead of JAX's bare errors.

    Not catchable: a coordinator that stays unreachable for ``initialization_timeout`` seconds
    makes XLA abort the process (a fatal DEADLINE_EXCEEDED in RegisterTask), and once joined,
    a peer that dies makes the coordination service abort the others within about
    ``heartbeat_timeout`` seconds -- so a lost host never leaves followers blocked forever.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id!r}")
    if not isinstance(coordinator, str) or not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", coordinator):
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialized in this process")
    if cpu_collectives:
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception as e:  # pragma: no cover - depends on the jax build
            raise RuntimeError(f"this jax ({jax.__version__}) has no gloo CPU collectives: "
                               f"{e}") from e
    logger.info("joining coordinator %s as process %d of %d (timeout %ds)", coordinator,
                process_id, num_processes, initialization_timeout)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=initialization_timeout,
                                   heartbeat_timeout_seconds=heartbeat_timeout,
                                   shutdown_timeout_seconds=heartbeat_timeout)
    except Exception as e:
        hint = ""
        if "must be called before" in str(e) or "already been initialized" in str(e):
            hint = " (initialize() must run before any JAX computation or jax.devices() call)"
        raise RuntimeError(f"process {process_id}/{num_processes} could not join the "
                           f"coordinator at {coordinator}{hint}: {e}") from e
    if jax.process_count() != num_processes or jax.process_index() != process_id:
        raise RuntimeError(f"distributed init gave process {jax.process_index()} of "
                           f"{jax.process_count()}, expected {process_id} of {num_processes}")


def shutdown() -> None:
    """Leave the distributed system (a barrier: every process should call it)."""
    jax.distributed.shutdown()


def is_leader() -> bool:
    return jax.process_index() == 0


# Global placement ---------------------------------------------------------------------------
def gather_logits(logits: jax.Array) -> np.ndarray:
    """The global logits ``[D*L, V]`` (rows split over all devices) as numpy on every process.

    A collective: every process must call it for every step.
    """
    if logits.is_fully_addressable:
        return np.asarray(logits)
    return np.asarray(multihost_utils.process_allgather(logits, tiled=True))


# Step protocol ------------------------------------------------------------------------------
def _pack(batches: Sequence[ForwardBatch]) -> tuple[np.ndarray, np.ndarray]:
    b0 = batches[0]
    T, R1, P, L = (len(b0.input_ids), len(b0.cu_q_lens), np.shape(b0.page_table)[1],
                   len(b0.logits_indices))
    R = R1 - 1
    want = _field_shapes(T, R, P, L)
    parts = []
    for k, b in enumerate(batches):
        for n in _FIELDS:
            a = np.asarray(getattr(b, n))
            if a.shape != want[n]:
                raise ValueError(f"rank {k} field {n} has shape {a.shape}, expected {want[n]} "
                                 f"(rank batches must share one bucket T={T} R={R} P={P} L={L})")
            if a.dtype.kind not in "iu":
                raise ValueError(f"rank {k} field {n} must be integer, got {a.dtype}")
            parts.append(a.astype(np.int32).ravel())
    header = np.array([0, T, R, P, L] + [int(b.mode) for b in batches], np.int32)
    return header, np.concatenate(parts)


def _unpack(header: np.ndarray, payload: np.ndarray, num_ranks: int) -> list[ForwardBatch]:
    T, R, P, L = (int(v) for v in header[1:_HEADER])
    shapes = _field_shapes(T, R, P, L)
    out, off = [], 0
    for k in range(num_ranks):
        fields = {}
        for n in _FIELDS:
            size = int(np.prod(shapes[n]))
            fields[n] = payload[off:off + size].reshape(shapes[n]).copy()
            off += size
        out.append(ForwardBatch(**fields, mode=ForwardMode(int(header[_HEADER + k]))))
    assert off == payload.size, (off, payload.size)
    return out


def _payload_size(header: np.ndarray, num_ranks: int) -> int:
    op = Op(int(header[0]))
    if op == Op.STEP:
        T, R, P, L = (int(v) for v in header[1:_HEADER])
        return num_ranks * sum(int(np.prod(s)) for s in _field_shapes(T, R, P, L).values())
    return 0 if op == Op.STOP else int(header[1])


def _exchange(header: np.ndarray | None, payload: np.ndarray | None, num_ranks: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """One message from the leader (``header`` and ``payload``; followers pass None) to every
    process: returns both on every process. A collective (one or two broadcasts)."""
    leader = is_leader()
    if header is None:
        header = np.zeros(_HEADER + num_ranks, np.int32)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=leader))
    size = _payload_size(header, num_ranks)
    if size == 0:
        return header, np.zeros(0, np.int32)
    if payload is None:
        payload = np.zeros(size, np.int32)
    return header, np.asarray(multihost_utils.broadcast_one_to_all(payload, is_source=leader))


def broadcast_step(batches: Sequence[ForwardBatch] | None, num_ranks: int
                   ) -> list[ForwardBatch] | None:
    """Send one step's D rank-local batches from the leader to every process.

    On the leader (process 0) ``batches`` is the list of D numpy batches of the step, or None
    to tell the followers to stop. Followers pass None (or use :func:`receive`, which also
    takes commands). Returns, on every process, the same D batches (numpy), or None when the
    leader sent stop. A collective: every process calls it once per step, in the same order
    as the other collectives of the step.
    """
    leader = is_leader()
    if not leader and batches is not None:
        raise ValueError("only the leader (process 0) supplies batches")
    header = payload = None
    if leader and batches is not None:
        if len(batches) != num_ranks:
            raise ValueError(f"need {num_ranks} rank batches, got {len(batches)}")
        header, payload = _pack(batches)
    elif leader:
        header = np.zeros(_HEADER + num_ranks, np.int32)
        header[0] = Op.STOP
    header, payload = _exchange(header, payload, num_ranks)
    op = Op(int(header[0]))
    if op not in (Op.STEP, Op.STOP):
        raise RuntimeError(f"expected a step from the leader, got {op.name}")
    return None if op == Op.STOP else _unpack(header, payload, num_ranks)


def send_command(op: Op, values: Sequence[int], num_ranks: int) -> None:
    """Leader only: announce command ``op`` with its int arguments to the followers."""
    if not is_leader():
        raise ValueError("only the leader (process 0) sends commands")
    if op in (Op.STEP, Op.STOP):
        raise ValueError(f"{op.name} goes through broadcast_step")
    header = np.zeros(_HEADER + num_ranks, np.int32)
    header[:2] = op, len(values)
    _exchange(header, np.asarray(values, np.int32).reshape(-1), num_ranks)


def receive(num_ranks: int) -> tuple[Op, list[ForwardBatch] | np.ndarray | None]:
    """Follower: the leader's next message: (STEP, batches), (STOP, None) or (command, ints)."""
    header, payload = _exchange(None, None, num_ranks)
    op = Op(int(header[0]))
    if op == Op.STEP:
        return op, _unpack(header, payload, num_ranks)
    return op, (None if op == Op.STOP else payload)


def share_from(process: int, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``arrays`` as process ``process`` holds them, on every process (the others pass arrays
    of the same shapes and dtypes, whose values are ignored). A collective."""
    if jax.process_count() == 1:
        return [np.asarray(a) for a in arrays]
    out = multihost_utils.broadcast_one_to_all(tuple(arrays),
                                               is_source=jax.process_index() == process)
    return [np.asarray(a) for a in out]


def step(dp: DPForward, params, cache, batches: Sequence[ForwardBatch]):
    """Place the step's batches, run ``dp`` and gather its outputs to every process.

    Returns (f32[D*L, V] numpy logits, the updated cache, the router stats as numpy (health
    f32[D*layers, 3], rows per expert slot f32[layers, P]) or None when ``dp`` has none).
    Every process runs it with the same batches (from :func:`broadcast_step`).
    """
    out = dp(params, cache, dp.put_batch(batches))
    stats = jax.tree.map(gather_logits, out[2]) if dp.with_stats else None
    return gather_logits(out[0]), out[1], stats


def run_step(dp: DPForward, params, cache, batches: Sequence[ForwardBatch]):
    """:func:`step` without the router stats: (f32[D*L, V] numpy logits, the updated cache)."""
    logits, cache, _ = step(dp, params, cache, batches)
    return logits, cache


class FollowerOps:
    """A follower's side of the leader's commands: the same snapshot copies and state
    transfers the leader runs, on the follower's devices (``snapshots`` None: the leader has
    no prefix cache)."""

    def __init__(self, snapshots, transfer):
        self.snapshots, self.transfer = snapshots, transfer

    def run(self, op: Op, values: np.ndarray, cache):
        """Run command ``op``; returns the cache (updated by loads and installs)."""
        if op in (Op.SNAPSHOT_LOAD, Op.SNAPSHOT_SAVE):
            triples = [tuple(int(v) for v in t) for t in values.reshape(-1, 3)]
            if op == Op.SNAPSHOT_LOAD:
                return self.snapshots.load(cache, triples)
            self.snapshots.save(cache, triples)
        elif op == Op.SNAPSHOT_WARM_UP:
            return self.snapshots.warmup(cache)
        elif op == Op.EXPORT:
            rank, slot, *pages = (int(v) for v in values)
            self.transfer.gather(cache, pages, slot, rank)
        elif op == Op.INSTALL:
            rank, slot, *pages = (int(v) for v in values)
            kv, conv, rec = self.transfer.empty_state(cache, len(pages))  # the leader's bytes
            return self.transfer.scatter(cache, kv, conv, rec, pages, slot, rank)
        elif op == Op.TRANSFER_WARM_UP:
            gather, scatter, max_pages = (int(v) for v in values)
            return self.transfer.warm_up(cache, max_pages, gather=bool(gather),
                                         scatter=bool(scatter))
        else:
            raise RuntimeError(f"unknown command {op!r} from the leader")
        return cache


def follower_loop(dp: DPForward, params, cache, ops: FollowerOps | None = None):
    """A follower's life: receive a step or a command, run it, until the leader sends stop.
    Returns the cache and the number of steps run."""
    steps = 0
    while True:
        op, msg = receive(dp.dp_size)
        if op == Op.STOP:
            return cache, steps
        if op == Op.STEP:
            _, cache, _ = step(dp, params, cache, msg)
            steps += 1
        elif ops is None:
            raise RuntimeError(f"the leader sent {op.name} but this follower has no FollowerOps")
        else:
            cache = ops.run(op, msg, cache)


def broadcast_ints(values: Sequence[int] | None, n: int) -> list[int]:
    """``n`` ints from the leader (``values``; followers pass None) to every process."""
    x = np.zeros(n, np.int64) if values is None else np.asarray(values, np.int64)
    if x.shape != (n,):
        raise ValueError(f"need {n} ints, got shape {x.shape}")
    return [int(v) for v in multihost_utils.broadcast_one_to_all(x, is_source=is_leader())]
