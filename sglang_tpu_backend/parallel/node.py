"""A node's entry into a multi-host replica (``--nnodes`` > 1): ``join`` (every node, before
anything touches a JAX device) and ``run_follower`` (a node of rank > 0: its whole life).

Above ``multihost.py`` (the step protocol), ``agreement.py`` (the argument and parameter
checks) and the state programs (``model_executor/state_snapshots.py``,
``state_transfer.py``) that a follower composes, so none of those imports another's caller.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from sglang_tpu_backend.config import DTYPES, load_model_config, resolve_dtype
from sglang_tpu_backend.model_executor.state_snapshots import GDNSnapshots
from sglang_tpu_backend.model_executor.state_transfer import StateTransfer
from sglang_tpu_backend.model_loader.sharded_loader import WeightSource
from sglang_tpu_backend.model_loader.tiny_model import with_default_model
from sglang_tpu_backend.parallel import agreement
from sglang_tpu_backend.parallel.dp_forward import DPForward
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.parallel.multihost import (FollowerOps, broadcast_ints, follower_loop,
                                                   initialize, shutdown)

logger = logging.getLogger(__name__)


def join(args) -> None:
    """Join the engine's process group from ``ServerArgs`` (``nnodes`` > 1): before anything
    touches a JAX device. CPU processes (``JAX_PLATFORMS=cpu``, the tests) use gloo. Then
    every node checks that all were started with the same model and step-shaping arguments
    (``agreement.py``): on a mismatch every node leaves the group and raises
    ``agreement.MismatchError`` naming the first argument that differs."""
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
    ``init_cache``, the parameter check (``agreement.py``), the snapshot sizes
    (``make_snapshots``), then every step and command (warm-up included) and the final stop.
    """
    if args.nnodes < 2 or args.node_rank < 1:
        raise ValueError("run_follower is for --node-rank >= 1 of --nnodes >= 2")
    join(args)
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
    cache = dp.init_cache(num_pages=num_pages, page_size=args.kv_page_size(jax.default_backend()),
                          num_state_slots=num_slots,
                          kv_dtype=args.kv_storage_dtype(jax.default_backend()))
    agreement.require_agreement("parameters", agreement.param_items(source.shapes()))
    params, report = source.load(dp.param_shardings(source.shapes()))
    logger.info("node %d read %.3f GB of weights in %.1f s", args.node_rank,
                report.bytes_read / 1e9, report.seconds)
    num_snapshots, max_copies = broadcast_ints(None, 2)  # the leader's make_snapshots
    snapshots = None
    if num_snapshots > 0:
        snapshots = GDNSnapshots(cache, num_snapshots, max_copies, dp)
    ops = FollowerOps(snapshots, StateTransfer(num_pages, num_slots, dp))
    logger.info("node %d follows: %d pages + %d state slots + %d GDN snapshots per rank",
                args.node_rank, num_pages, num_slots, num_snapshots)
    _, steps = follower_loop(dp, params, cache, ops)
    logger.info("node %d: the leader stopped after %d steps", args.node_rank, steps)
    shutdown()
    return steps
