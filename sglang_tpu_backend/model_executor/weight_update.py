"""Weights for ``/update_weights_from_disk``: load a checkpoint on the host, check it fits the
serving model, and check its placed arrays match the ones they replace. Under NEXTN the MTP
layers' weights (``mtp.*``) are reloaded too (``load_host_mtp_params``).

Nothing here touches the engine: ``load_host_params`` and ``check_placed`` raise
``WeightUpdateError`` (one line naming the problem) and the engine keeps its old weights.
The swap itself (between steps, pools idle) is the engine's (``Engine.update_weights_from_disk``).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Any

import jax

from sglang_tpu_backend.config import ConfigError, ModelConfig, load_model_config

LOAD_FORMATS = (None, "auto", "safetensors")  # what ``load_format`` may say
# Checkpoint forms of one architecture: nested text_config vs the flat text-only config.
_SAME_ARCHITECTURE = {"qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5"}


class WeightUpdateError(ValueError):
    """A weight update is refused before anything changed; the message names the cause."""


def param_spec(params: Any) -> Any:
    """Shape and dtype of every leaf of a params tree (``jax.ShapeDtypeStruct`` mirror)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)


def check_same_config(old: ModelConfig, new: ModelConfig, model_path: str) -> None:
    """Raise unless ``new`` describes the serving architecture (every field equal; the nested
    and flat Qwen3.5-MoE config forms count as one ``model_type``)."""
    diffs = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "model_type" and _SAME_ARCHITECTURE.get(a, a) == _SAME_ARCHITECTURE.get(b, b):
            continue
        if a != b:
            diffs.append(f"{f.name} {b!r} (serving {a!r})")
    if diffs:
        more = f"; ... and {len(diffs) - 4} more" if len(diffs) > 4 else ""
        raise WeightUpdateError(f"checkpoint {model_path} has a different architecture: "
                                + "; ".join(diffs[:4]) + more)


def _host_device():
    """The CPU device new weights are read onto (the accelerator keeps serving meanwhile)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process: the default device
        return None


def load_host_params(model_path: str, cfg: ModelConfig, spec: Any, *, dtype: Any) -> Any:
    """Read ``model_path`` into a params tree on the host, in ``dtype``, and check its config
    against ``cfg`` and every leaf's shape and dtype against ``spec`` (``param_spec`` of the
    serving params before placement). Raises WeightUpdateError naming the problem."""
    from sglang_tpu_backend.model_loader.loader import CheckpointError, load_params

    if not Path(model_path).is_dir():
        raise WeightUpdateError(f"model_path {model_path} is not a directory")
    try:
        new_cfg = load_model_config(model_path)
        check_same_config(cfg, new_cfg, model_path)
        with jax.default_device(_host_device()):
            params = load_params(model_path, new_cfg, dtype=dtype, progress=False)
    except (ConfigError, CheckpointError, OSError) as e:
        raise WeightUpdateError(f"cannot load {model_path}: {e}") from None
    check_tree(spec, params, model_path)
    return params


def load_host_mtp_params(model_path: str, cfg: ModelConfig, spec: Any, *, dtype: Any) -> Any:
    """NEXTN: ``model_path``'s MTP params (``mtp.*``) on the host in ``dtype``, each leaf
    checked against ``spec`` (``param_spec`` of the serving MTP params); the config was
    checked by ``load_host_params``. Raises WeightUpdateError when it has none or they differ."""
    from sglang_tpu_backend.model_loader.loader import CheckpointError, load_mtp_params

    try:
        with jax.default_device(_host_device()):
            mtp = load_mtp_params(model_path, cfg, dtype=dtype)
    except (CheckpointError, OSError) as e:
        raise WeightUpdateError(f"cannot load the MTP weights of {model_path}: {e}") from None
    if mtp is None:
        raise WeightUpdateError(f"checkpoint {model_path} has no mtp.* tensors: this engine "
                                "drafts with --speculative-algorithm NEXTN, whose MTP layers "
                                "an update reloads too")
    check_tree(spec, mtp, model_path)
    return mtp


def _describe(path) -> str:
    return jax.tree_util.keystr(path)


def check_tree(spec: Any, params: Any, model_path: str) -> None:
    """Raise unless ``params`` has ``spec``'s tree structure and each leaf its shape / dtype."""
    want = jax.tree_util.tree_flatten_with_path(spec)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want_keys = {_describe(p) for p, _ in want}
    got_keys = {_describe(p) for p, _ in got}
    if want_keys != got_keys:
        missing, extra = sorted(want_keys - got_keys), sorted(got_keys - want_keys)
        raise WeightUpdateError(f"checkpoint {model_path} gives a different parameter tree "
                                f"(missing {missing[:3]}, unexpected {extra[:3]})")
    got_by_key = {_describe(p): a for p, a in got}
    for p, s in want:
        a = got_by_key[_describe(p)]
        if tuple(a.shape) != tuple(s.shape) or a.dtype != s.dtype:
            raise WeightUpdateError(
                f"checkpoint {model_path}: parameter {_describe(p)} is {a.dtype}{list(a.shape)}, "
                f"the serving model's is {s.dtype}{list(s.shape)}")


def placement(a: jax.Array) -> tuple:
    """What a jitted step's cache key sees of an argument besides its value: shape, dtype,
    sharding, committedness and (where the array has one) its device layout."""
    return (tuple(a.shape), a.dtype, a.sharding, a.committed, getattr(a, "format", None))


def check_placed(old: Any, new: Any) -> None:
    """Raise unless every placed new leaf matches the old one's ``placement`` (a mismatch would
    make the next step recompile)."""
    old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
    new_leaves = jax.tree.leaves(new)
    if len(old_leaves) != len(new_leaves):
        raise WeightUpdateError(f"placed weights have {len(new_leaves)} arrays, serving {len(old_leaves)}")
    for (p, a), b in zip(old_leaves, new_leaves):
        if placement(a) != placement(b):
            raise WeightUpdateError(f"placed parameter {_describe(p)} differs from the serving one: "
                                    f"{placement(b)} vs {placement(a)}")


def next_weight_version(current: str, given: str | None) -> str:
    """``given`` when set; else ``current`` with its trailing number incremented
    (``"3"`` -> ``"4"``, ``"step-7"`` -> ``"step-8"``), or ``"1"`` when it has none
    (the startup ``"default"``)."""
    if given is not None:
        return given
    m = re.fullmatch(r"(.*?)(\d+)", current)
    return f"{m.group(1)}{int(m.group(2)) + 1}" if m else "1"


def update_result(success: bool, message: str, num_paused_requests: int = 0) -> dict:
    """SGLang's ``/update_weights_from_disk`` answer (``UpdateWeightFromDiskReqOutput``)."""
    return {"success": success, "message": message, "num_paused_requests": num_paused_requests}


class PendingSwap:
    """A validated, placed weight update waiting for the engine loop to swap it in.

    ``finish`` records the answer (``update_result``) and wakes the caller waiting on ``done``.
    """

    def __init__(self, params: Any, version: str, model_path: str, mtp_params: Any = None,
                 flush_cache: bool = True, base: Any = None):
        self.params = params
        self.base = base  # the serving params ``params`` shares leaves with (tensor updates)
        self.flush_cache = flush_cache  # flush the prefix cache at the swap
        self.mtp_params = mtp_params  # NEXTN: the placed MTP params (else None)
        self.version = version
        self.model_path = model_path
        self.queued_at = time.monotonic()
        self.done = threading.Event()
        self.result: dict | None = None

    def finish(self, success: bool, message: str, num_paused_requests: int = 0) -> None:
        # The engine holds the arrays now (or they are dropped).
        self.params = self.mtp_params = self.base = None
        self.result = update_result(success, message, num_paused_requests)
        self.done.set()
