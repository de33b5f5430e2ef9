"""Multi-host consistency: every process of an engine must run the same model with the same
step-shaping arguments, or the followers' steps silently differ from the leader's (other
shapes hang a collective; other weights or dtypes give other logits).

Two checks, each a collective every process makes at the same point:
  "server arguments" at join (``node.join``): the model's config (every field of the
      parsed ``ModelConfig``, not its path: nodes may hold the checkpoint at different paths)
      and the ``ServerArgs`` fields that shape the steps and the caches (``SHARED_ARGS``).
  "parameters" before loading (the leader's ``MultiHostDPBackend.load_params``, the
      follower's ``node.run_follower``): name, shape and dtype of every param to load.

Each process hashes its items (sha256 of their canonical JSON) and all processes gather the
digests. If they all agree, that is all. Otherwise the processes gather each other's items,
every one of them builds the same message naming the first key that differs and its value on
each node, leaves the process group and raises ``MismatchError``: no node is left waiting in
a collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

import numpy as np

# ServerArgs fields every node must agree on: what sizes the caches and the step buckets,
# what dtype and kernels the steps run with, and the mesh.
SHARED_ARGS = ("dtype", "page_size", "context_length", "max_running_requests",
               "chunked_prefill_size", "max_total_tokens", "mem_fraction_static",
               "device_memory_bytes", "dp_size", "ep_size", "tp_size", "nnodes", "kernel_impl",
               "enable_deterministic_inference", "disable_radix_cache", "max_gdn_snapshots",
               "load_format", "random_seed")  # the last two: every node's dummy weights alike


class MismatchError(RuntimeError):
    """The processes of a multi-host engine were started with different models or arguments."""


def server_arg_items(args: Any) -> dict[str, str]:
    """The items of ``ServerArgs`` ``args`` that must agree: ``model.<field>`` for every field
    of the model's config, ``--<flag>`` for ``SHARED_ARGS`` (and ``max_tokens_per_step``),
    values as JSON."""
    from sglang_tpu_backend.config import load_model_config, resolve_dtype

    model_path = args.model_path
    if model_path is None:
        from sglang_tpu_backend.model_loader.tiny_model import default_model_path

        model_path = default_model_path()
    cfg = dataclasses.asdict(load_model_config(model_path))
    items = {f"model.{k}": json.dumps(v, sort_keys=True, default=str) for k, v in cfg.items()}
    for name in (*SHARED_ARGS, "max_tokens_per_step"):
        items["--" + name.replace("_", "-")] = json.dumps(getattr(args, name))
    items["--dtype"] = json.dumps(resolve_dtype(args.dtype, model_path))  # "auto" resolved
    return items


def param_items(spec: Any) -> dict[str, str]:
    """A params tree (or its ``weight_update.param_spec`` mirror) as items: each leaf's path ->
    "shape dtype"."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(spec)[0]
    return {jax.tree_util.keystr(path): f"{list(x.shape)} {np.dtype(x.dtype).name}"
            for path, x in leaves}


def describe_mismatch(what: str, tables: list[dict[str, str]]) -> str | None:
    """The message naming the first key (in sorted order) whose value is not the same on
    every process (``tables[p]``: process p's items), or None if all agree."""
    keys = sorted(set().union(*tables))
    for key in keys:
        values = [t.get(key, "<missing>") for t in tables]
        if len(set(values)) > 1:
            per_node = ", ".join(f"node {p}: {v}" for p, v in enumerate(values))
            return (f"the nodes' {what} differ at {key} ({per_node}); start every node with "
                    f"the same model and the same arguments")
    return None


def _digest(blob: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(blob).digest(), np.int32)  # int32[8]


def _allgather(x: np.ndarray) -> np.ndarray:
    """``x`` of every process, stacked on a new leading axis (a collective)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def require_agreement(what: str, items: Mapping[str, str]) -> None:
    """Raise ``MismatchError`` on every process unless every process passes the same
    ``items`` (a collective: all processes call it at the same point; see the module
    docstring). ``what`` names the group in the message ("server arguments", "parameters")."""
    import jax

    from sglang_tpu_backend.parallel import multihost

    rank = jax.process_index()
    blob = json.dumps(dict(items), sort_keys=True).encode()
    digests = _allgather(_digest(blob))
    if (digests == digests[0]).all():
        return
    sizes = _allgather(np.array([len(blob)], np.int32))[:, 0]
    padded = np.zeros(int(sizes.max()), np.int32)
    padded[:len(blob)] = np.frombuffer(blob, np.uint8)
    blobs = _allgather(padded)
    tables = [json.loads(bytes(b[:n].astype(np.uint8))) for b, n in zip(blobs, sizes)]
    message = describe_mismatch(what, tables) or f"the nodes' {what} differ"
    multihost.shutdown()
    raise MismatchError(f"node {rank}: {message}")
