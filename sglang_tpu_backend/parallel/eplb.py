"""Expert-parallel load balancing (EPLB): which physical expert slot holds which expert.

Dimension letters: L MoE layers, E logical experts (the checkpoint's), P physical slots per
layer (E + ``--ep-num-redundant-experts``), D EP ranks (rank r holds slots
[r*P/D, (r+1)*P/D)), C = P - E + 1 copies at most of one expert.

An :class:`ExpertLocation` is the map per MoE layer: ``logical[l, p]`` is the expert that
physical slot p holds. Every expert has at least one slot; the redundant slots hold extra
copies of hot experts, so the rows routed to a hot expert are split between its copies
(each routed (token, k) picks copy ``(token row + k) mod copies``, ``models/moe.py``).

:func:`place_experts` computes a placement from per-expert loads (routed-token counts): the
redundant copies go one by one to the expert with the highest load per copy, then the copies
are packed onto the ranks hottest first, each onto the least-loaded rank that still has a
free slot (greedy longest-processing-time), preferring ranks without a copy of it.

Load files (``--init-expert-location``, written by the engine): JSON
``{"format": LOAD_FILE_FORMAT, "num_experts": E, "moe_layers": [layer ids], "loads": [[E
counts] per MoE layer]}``. Everything here is numpy on the host.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

LOAD_FILE_FORMAT = "sglang-tpu-expert-loads-v1"


@dataclasses.dataclass(frozen=True)
class ExpertLocation:
    """Physical slot -> logical expert, per MoE layer: ``logical`` i32[L, P]."""

    logical: np.ndarray
    num_experts: int

    def __post_init__(self):
        lg = np.asarray(self.logical, np.int32)
        object.__setattr__(self, "logical", lg)
        if lg.ndim != 2 or lg.shape[1] < self.num_experts:
            raise ValueError(f"logical map must be [layers, >= {self.num_experts}], got {lg.shape}")
        if lg.min() < 0 or lg.max() >= self.num_experts:
            raise ValueError(f"slots must hold expert ids 0..{self.num_experts - 1}, got "
                             f"{lg.min()}..{lg.max()}")
        missing = np.argwhere(self.copies() == 0)
        if missing.size:
            raise ValueError(f"every expert needs a slot; (layer, expert) without one: "
                             f"{missing[:4].tolist()}")

    @property
    def num_layers(self) -> int:
        return self.logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.logical.shape[1]

    @property
    def max_copies(self) -> int:
        """C: the most copies one expert can have (static: the tables' width)."""
        return self.num_physical - self.num_experts + 1

    @classmethod
    def trivial(cls, num_layers: int, num_experts: int, num_physical: int) -> "ExpertLocation":
        """Slot p holds expert p mod E (the identity when P == E)."""
        row = np.arange(num_physical, dtype=np.int32) % num_experts
        return cls(np.tile(row, (num_layers, 1)), num_experts)

    def copies(self) -> np.ndarray:
        """Slots per expert i32[L, E]."""
        L, E = self.logical.shape[0], self.num_experts
        bins = self.logical + E * np.arange(L)[:, None]  # [L, P]: layer-major expert bins
        return np.bincount(bins.ravel(), minlength=L * E).reshape(L, E).astype(np.int32)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(physical i32[L, E, C], copies i32[L, E]): expert e's slots in ascending order in
        ``physical[l, e, :copies[l, e]]``, the rest padded with its first slot."""
        L, E, C = self.num_layers, self.num_experts, self.max_copies
        copies = self.copies()
        by_expert = np.argsort(self.logical, axis=1, kind="stable")  # [L, P] slots by expert
        first = np.cumsum(copies, axis=1) - copies  # [L, E]: position of e's first slot
        c = np.arange(C)
        pos = first[:, :, None] + np.where(c < copies[:, :, None], c, 0)  # [L, E, C]
        physical = np.take_along_axis(by_expert, pos.reshape(L, -1), axis=1).reshape(L, E, C)
        return physical.astype(np.int32), copies

    def rank_loads(self, physical_loads: np.ndarray, num_ranks: int) -> np.ndarray:
        """Rows per EP rank f[L, D] from rows per physical slot f[L, P]."""
        loads = np.asarray(physical_loads, np.float64)
        return loads.reshape(self.num_layers, num_ranks, -1).sum(-1)

    def split_loads(self, logical_loads: np.ndarray) -> np.ndarray:
        """Expected rows per physical slot f[L, P] when each expert's rows f[L, E] split
        evenly over its copies."""
        per_copy = np.asarray(logical_loads, np.float64) / self.copies()  # [L, E]
        return np.take_along_axis(per_copy, self.logical, axis=1)

    def logical_loads(self, physical_loads: np.ndarray) -> np.ndarray:
        """Rows per logical expert f[L, E]: the sum over each expert's slots."""
        L, E = self.num_layers, self.num_experts
        bins = self.logical + E * np.arange(L)[:, None]  # [L, P]: layer-major expert bins
        weights = np.asarray(physical_loads, np.float64).ravel()
        return np.bincount(bins.ravel(), weights=weights, minlength=L * E).reshape(L, E)


def balance_ratio(rank_loads: np.ndarray) -> np.ndarray:
    """Per layer max / mean of the rows per rank f[L, D] -> f[L] (1 = balanced; NaN if idle)."""
    loads = np.asarray(rank_loads, np.float64)
    mean = loads.mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, loads.max(axis=1) / mean, np.nan)


def _replicate(loads: np.ndarray, num_physical: int, max_per_expert: int) -> np.ndarray:
    """Copies i32[E] per expert: one each, then each redundant slot to the expert of highest
    load per copy (lowest id on ties; at most ``max_per_expert`` copies)."""
    copies = np.ones(loads.size, np.int64)
    for _ in range(num_physical - loads.size):
        per_copy = np.where(copies < max_per_expert, loads / copies, -np.inf)
        copies[int(np.argmax(per_copy))] += 1
    return copies


def _pack(loads: np.ndarray, copies: np.ndarray, num_ranks: int) -> np.ndarray:
    """Slot -> expert i32[P]: copies packed hottest first, each onto the least-loaded rank with
    a free slot (ranks holding no copy of the expert first, ties to the lower rank); each rank's
    slots then sorted by expert id."""
    per_rank = int(copies.sum()) // num_ranks
    items = sorted(((loads[e] / copies[e], e) for e in range(loads.size) for _ in range(copies[e])),
                   key=lambda it: (-it[0], it[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = np.zeros(num_ranks)
    for load, e in items:
        r = min((r for r in range(num_ranks) if len(held[r]) < per_rank),
                key=lambda r: (e in held[r], rank_load[r], r))
        held[r].append(e)
        rank_load[r] += load
    return np.concatenate([np.sort(h) for h in held]).astype(np.int32)


def place_experts(loads: np.ndarray, num_physical: int, num_ranks: int) -> ExpertLocation:
    """A placement balancing ``loads`` f[L, E] (routed rows per expert per MoE layer) over
    ``num_ranks`` ranks with ``num_physical`` slots per layer (a multiple of ``num_ranks``,
    at least E). Deterministic."""
    loads = np.asarray(loads, np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
    L, E = loads.shape
    if num_physical < E or num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical slots must be >= {E} experts and a multiple of "
                         f"{num_ranks} EP ranks")
    # Layers never measured (all zero) get equal loads: a copy each, spread by id.
    loads = np.where(loads.sum(axis=1, keepdims=True) > 0, loads, 1.0)
    logical = np.stack([_pack(row, _replicate(row, num_physical, num_ranks), num_ranks)
                        for row in loads])
    return ExpertLocation(logical, E)


# Load files -----------------------------------------------------------------------------------


def write_load_file(path: str | Path, loads: np.ndarray, moe_layers: list[int]) -> None:
    """Write per-MoE-layer per-expert routed-row counts ``loads`` [L, E] as a load file."""
    loads = np.asarray(loads)
    doc = {"format": LOAD_FILE_FORMAT, "num_experts": int(loads.shape[1]),
           "moe_layers": [int(x) for x in moe_layers],
           "loads": [[int(round(v)) for v in row] for row in loads]}
    Path(path).write_text(json.dumps(doc))


def read_load_file(path: str | Path, num_experts: int, moe_layers: list[int]) -> np.ndarray:
    """Loads f[L, E] of a load file for a model with ``num_experts`` experts on MoE layers
    ``moe_layers``. ValueError naming ``--init-expert-location`` on any mismatch."""
    flag = "--init-expert-location"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: cannot read a JSON load file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != LOAD_FILE_FORMAT:
        raise ValueError(f"{flag} {path}: not a load file (format must be {LOAD_FILE_FORMAT!r})")
    if doc.get("num_experts") != num_experts or doc.get("moe_layers") != list(moe_layers):
        raise ValueError(f"{flag} {path}: recorded for {doc.get('num_experts')} experts on "
                         f"layers {doc.get('moe_layers')}, the model has {num_experts} on "
                         f"{list(moe_layers)}")
    try:
        loads = np.asarray(doc["loads"], np.float64)
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"{flag} {path}: 'loads' must be a [layers][experts] number "
                         "array") from None
    if loads.shape != (len(moe_layers), num_experts) or (loads < 0).any():
        raise ValueError(f"{flag} {path}: 'loads' must be non-negative "
                         f"[{len(moe_layers)}][{num_experts}], got shape {list(loads.shape)}")
    return loads


class ExpertLoadRecorder:
    """Routed rows per physical slot f[L, P], summed over the steps the host hands it
    (``add``, each step's real tokens of every rank)."""

    def __init__(self, num_layers: int, num_physical: int):
        self.counts = np.zeros((num_layers, num_physical))
        self.num_steps = 0

    def add(self, step_counts: np.ndarray) -> None:
        self.counts += step_counts
        self.num_steps += 1

    def reset(self) -> None:
        self.counts[:] = 0
        self.num_steps = 0
