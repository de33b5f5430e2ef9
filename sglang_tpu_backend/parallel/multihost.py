"""Multi-process (multi-host) execution of the DP x EP step.

Several processes (one per TPU host; CPU processes in the tests) form one JAX mesh and run the
same ``DPForward`` step on it. Every process calls :func:`initialize` before touching JAX,
loads its devices' share of the same parameters (``sharded_loader.py``: replicated weights
whole, routed experts only its own), and builds the same ``DPForward`` over the global mesh
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

The header is a fixed-shape ``int32[5 + D]`` array ``(stop, T, R, P, L, mode_0..mode_{D-1})``
broadcast with ``multihost_utils.broadcast_one_to_all``; the payload that follows is one flat
``int32`` vector holding the D ranks' batch fields (its size follows from the header, so a
follower can allocate it). No sockets or pickle: both go through JAX collectives on the
mesh's devices (gloo on CPU, ICI/DCN on TPU).

Placement: ``sharded_loader.load_sharded`` / ``DPForward.init_cache`` / ``put_batch`` build
global arrays with ``jax.make_array_from_callback``, each process supplying only its own
devices' shards (the weights it read for them, the batches it received), so the same calls
serve one process and several.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.parallel.dp_forward import DPForward

__all__ = [
    "initialize", "shutdown", "is_leader", "gather_logits", "broadcast_step", "run_step",
    "step", "follower_loop", "broadcast_ints", "join", "run_follower",
]

# Batch fields in payload order (all int32) and their per-rank shapes from (T, R, P, L).
logger = logging.getLogger(__name__)

_FIELDS = ("input_ids", "positions", "cu_q_lens", "kv_lens", "page_table", "state_slots",
           "num_seqs", "logits_indices")
_HEADER = 5  # stop, T, R, P, L (then one mode per rank)


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
    T, R, P, L = (int(v) for v in header[1:_HEADER])
    return num_ranks * sum(int(np.prod(s)) for s in _field_shapes(T, R, P, L).values())


def broadcast_step(batches: Sequence[ForwardBatch] | None, num_ranks: int
                   ) -> list[ForwardBatch] | None:
    """Send one step's D rank-local batches from the leader to every process.

    On the leader (process 0) ``batches`` is the list of D numpy batches of the step, or None
    to tell the followers to stop. Followers pass None. Returns, on every process, the same D
    batches (numpy), or None when the leader sent stop. A collective: every process calls it
    once per step, in the same order as the other collectives of the step.
    """
    leader = is_leader()
    if not leader and batches is not None:
        raise ValueError("only the leader (process 0) supplies batches")
    if leader and batches is not None:
        if len(batches) != num_ranks:
            raise ValueError(f"need {num_ranks} rank batches, got {len(batches)}")
        header, payload = _pack(batches)
    else:
        header = np.zeros(_HEADER + num_ranks, np.int32)
        if leader:
            header[0] = 1  # stop
        payload = None
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=leader))
    if header[0]:
        return None
    if payload is None:
        payload = np.zeros(_payload_size(header, num_ranks), np.int32)
    payload = np.asarray(multihost_utils.broadcast_one_to_all(payload, is_source=leader))
    return _unpack(header, payload, num_ranks)


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


def follower_loop(dp: DPForward, params, cache):
    """A follower's life: receive a step, run it, until the leader sends stop. Returns the
    cache and the number of steps run."""
    steps = 0
    while (batches := broadcast_step(None, dp.dp_size)) is not None:
        _, cache, _ = step(dp, params, cache, batches)
        steps += 1
    return cache, steps


def broadcast_ints(values: Sequence[int] | None, n: int) -> list[int]:
    """``n`` ints from the leader (``values``; followers pass None) to every process."""
    x = np.zeros(n, np.int64) if values is None else np.asarray(values, np.int64)
    if x.shape != (n,):
        raise ValueError(f"need {n} ints, got shape {x.shape}")
    return [int(v) for v in multihost_utils.broadcast_one_to_all(x, is_source=is_leader())]


# Engine processes ---------------------------------------------------------------------------
def join(args) -> None:
    """Join the engine's process group from ``ServerArgs`` (``nnodes`` > 1): before anything
    touches a JAX device. CPU processes (``JAX_PLATFORMS=cpu``, the tests) use gloo. Then
    every node checks that all were started with the same model and step-shaping arguments
    (``agreement.py``): on a mismatch every node leaves the group and raises
    ``agreement.MismatchError`` naming the first argument that differs."""
    import os

    from sglang_tpu_backend.parallel import agreement

    platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").split(",")
    initialize(args.dist_init_addr, args.nnodes, args.node_rank,
               cpu_collectives=platforms[0] == "cpu")
    agreement.require_agreement("server arguments", agreement.server_arg_items(args))


def run_follower(args) -> int:
    """A follower node's whole life (``--node-rank`` > 0): join, load its share of the params, build
    the same DP x EP step and caches as the leader's ``ModelRunner`` (whose cache sizes and
    stats flag it receives), run the leader's steps until it stops; returns the steps run.

    The leader (``Engine`` in node 0, its ``backends.MultiHostDPBackend``) makes the matching
    collectives in the same order: the argument check at join, the sizes broadcast,
    ``init_cache``, the parameter check (``agreement.py``), then every step (warm-up
    included) and the final stop.
    """
    from sglang_tpu_backend.config import DTYPES, cache_storage_dtype, load_model_config, resolve_dtype
    from sglang_tpu_backend.sharded_loader import WeightSource
    from sglang_tpu_backend.parallel import agreement
    from sglang_tpu_backend.parallel.mesh import make_mesh

    if args.nnodes < 2 or args.node_rank < 1:
        raise ValueError("run_follower is for --node-rank >= 1 of --nnodes >= 2")
    join(args)
    from sglang_tpu_backend.tiny_model import with_default_model

    args = with_default_model(args)
    cfg = load_model_config(args.model_path)
    args.check_devices(len(jax.devices()), cfg.num_experts)
    args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, args.model_path))
    source = WeightSource(cfg, args.model_path, args.load_format, DTYPES[args.dtype],
                          seed=args.random_seed)
    num_pages, num_slots, with_stats = broadcast_ints(None, 3)
    dp = DPForward(cfg, make_mesh(args.dp_size), impl=args.kernel_impl,
                   with_stats=bool(with_stats),
                   batch_invariant=args.enable_deterministic_inference)
    cache = dp.init_cache(num_pages=num_pages, page_size=args.page_size,
                          num_state_slots=num_slots,
                          kv_dtype=cache_storage_dtype(DTYPES[args.dtype], jax.default_backend()))
    agreement.require_agreement("parameters", agreement.param_items(source.shapes()))
    params, report = source.load(dp.param_shardings(source.shapes()))
    logger.info("node %d read %.3f GB of weights in %.1f s", args.node_rank,
                report.bytes_read / 1e9, report.seconds)
    logger.info("node %d follows: %d pages + %d state slots per rank", args.node_rank,
                num_pages, num_slots)
    _, steps = follower_loop(dp, params, cache)
    logger.info("node %d: the leader stopped after %d steps", args.node_rank, steps)
    shutdown()
    return steps
