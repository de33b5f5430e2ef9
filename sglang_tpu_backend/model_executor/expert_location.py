"""EPLB on the params tree: routed experts stored per physical slot, and moved between steps.

Dimension letters as in ``parallel/eplb.py`` (L MoE layers, E experts, P physical slots, C
copies at most) plus G layer groups (``qwen3_5_moe.stack_layers``): group position j's
expert leaves are [G, E, ...] (layer g*period + j at index g).

:func:`apply_location` turns loaded (logical) params into physical ones on the host: each
expert leaf becomes [G, P, ...] (slot p of layer l a copy of expert ``logical[l, p]``) and
the position's ``mlp`` gains ``expert_location`` = {physical i32[G, E, C], copies i32[G, E],
logical i32[G, P]}: ordinary (replicated) inputs of the step, so a new placement recompiles
nothing. :class:`ExpertMover` re-places placed params on the devices: every new slot is
gathered from an old slot holding the same expert (on the same EP rank when one does), one
layer group at a time in place (the weights are donated: the temporary is one group's
experts), and the location arrays are swapped; shapes, shardings and layouts stay the same.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.parallel.eplb import ExpertLocation

Params = dict[str, Any]


def moe_layers(cfg: ModelConfig) -> list[int]:
    """Layer ids of the MoE layers, in order (MoE layer m of an ExpertLocation is the m-th)."""
    return [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]


def _group_rows(cfg: ModelConfig, j: int) -> list[int]:
    """MoE-layer index of each group's layer at position j (layer g*period + j)."""
    index = {layer: m for m, layer in enumerate(moe_layers(cfg))}
    return [index[layer] for layer in range(j, cfg.num_hidden_layers, cfg.layer_period)]


def location_arrays(location: ExpertLocation, cfg: ModelConfig, j: int) -> dict[str, np.ndarray]:
    """Position j's ``expert_location`` leaves (numpy), rows in group order."""
    rows = _group_rows(cfg, j)
    physical, copies = location.tables()
    return {"physical": physical[rows], "copies": copies[rows], "logical": location.logical[rows]}


def apply_location(params: Params, cfg: ModelConfig, location: ExpertLocation) -> Params:
    """Logical params (as loaded) -> physical ones for ``location`` (see the module doc)."""
    if location.num_layers != len(moe_layers(cfg)) or location.num_experts != cfg.num_experts:
        raise ValueError(f"expert location of {location.num_layers} layers x "
                         f"{location.num_experts} experts does not fit the model's "
                         f"{len(moe_layers(cfg))} x {cfg.num_experts}")
    groups = []
    for j, p in enumerate(params["layer_groups"]):
        mlp = p.get("mlp", {})
        if "experts" not in mlp:
            groups.append(p)
            continue
        arrays = location_arrays(location, cfg, j)
        src = jnp.asarray(arrays["logical"])  # [G, P]
        g = jnp.arange(src.shape[0])[:, None]
        experts = jax.tree.map(lambda a: a[g, src], mlp["experts"])  # [G, P, ...]
        loc = {k: jnp.asarray(v) for k, v in arrays.items()}
        groups.append({**p, "mlp": {**mlp, "experts": experts, "expert_location": loc}})
    return {**params, "layer_groups": tuple(groups)}


def params_location(params: Params, cfg: ModelConfig) -> ExpertLocation:
    """The ExpertLocation that placed (or host) physical params hold (their ``logical`` maps)."""
    rows = np.zeros((len(moe_layers(cfg)), 0), np.int32)
    for j, p in enumerate(params["layer_groups"]):
        loc = p.get("mlp", {}).get("expert_location")
        if loc is None:
            continue
        logical = np.asarray(jax.device_get(loc["logical"]))  # [G, P]
        if rows.shape[1] == 0:
            rows = np.zeros((rows.shape[0], logical.shape[1]), np.int32)
        rows[_group_rows(cfg, j)] = logical
    return ExpertLocation(rows, cfg.num_experts)


def source_slots(old: np.ndarray, new: np.ndarray, num_ranks: int) -> np.ndarray:
    """For each new slot i32[P] (one layer) an old slot holding the same expert: one on the
    same EP rank when there is one, else its first."""
    per_rank = old.size // num_ranks
    src = np.empty(new.size, np.int32)
    for p, e in enumerate(new):
        holders = np.flatnonzero(old == e)
        local = holders[holders // per_rank == p // per_rank]
        src[p] = local[0] if local.size else holders[0]
    return src


def _move_groups(experts, src):
    """experts leaves [G, P, ...] (donated), src i32[G, P]: slot p of group g := old slot
    src[g, p], one group per loop iteration (updated in place)."""

    def body(g, ex):
        return jax.tree.map(lambda a: a.at[g].set(a[g][src[g]]), ex)

    return jax.lax.fori_loop(0, src.shape[0], body, experts)


class ExpertMover:
    """Moves placed physical params to a new ExpertLocation on their devices (one compiled
    program per layer-group position, made on first use and reused after)."""

    def __init__(self, cfg: ModelConfig, num_ranks: int):
        self.cfg, self.num_ranks = cfg, num_ranks
        self._programs: dict[int, Any] = {}

    def _program(self, j: int, experts):
        if j not in self._programs:
            shardings = jax.tree.map(lambda a: a.sharding, experts)
            self._programs[j] = jax.jit(_move_groups, donate_argnums=0, out_shardings=shardings)
        return self._programs[j]

    def move(self, params: Params, location: ExpertLocation) -> Params:
        """``params`` (placed, physical; consumed: its expert arrays are donated) re-placed for
        ``location``."""
        old = params_location(params, self.cfg)
        if old.logical.shape != location.logical.shape:
            raise ValueError(f"new placement has shape {location.logical.shape}, the params "
                             f"{old.logical.shape}")
        groups = []
        for j, p in enumerate(params["layer_groups"]):
            mlp = p.get("mlp", {})
            if "expert_location" not in mlp:
                groups.append(p)
                continue
            rows = _group_rows(self.cfg, j)
            src = np.stack([source_slots(old.logical[m], location.logical[m], self.num_ranks)
                            for m in rows])  # [G, P]
            placed_src = jax.device_put(src, mlp["expert_location"]["logical"].sharding)
            experts = self._program(j, mlp["experts"])(mlp["experts"], placed_src)
            arrays = location_arrays(location, self.cfg, j)
            loc = {k: jax.device_put(v, mlp["expert_location"][k].sharding)
                   for k, v in arrays.items()}
            groups.append({**p, "mlp": {**mlp, "experts": experts, "expert_location": loc}})
        return {**params, "layer_groups": tuple(groups)}
