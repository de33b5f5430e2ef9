"""The device mesh of one DP x EP step and the static context the MoE layers read.

All devices of a host (Ironwood: 4 chips x 2 TensorCores = 8 JAX devices) form one mesh with
axes ("chip", "die"). Attention and GDN run data-parallel over the whole mesh (each device a
DP rank owning whole requests, its own KV pages and GDN state slots); routed experts are split
over the same devices (EP rank = DP rank). A device's linear rank is ``chip * num_dies + die``,
the order of tiled all-gathers and of the reduce-scatter in ``kernels/collectives.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

CHIP_AXIS, DIE_AXIS = "chip", "die"


@dataclasses.dataclass(frozen=True)
class EPContext:
    """Static description of the expert-parallel axes (hashable: a jit static argument).

    chip_axis, die_axis: mesh axis names; the EP ranks are every (chip, die) device.
    num_microbatches: micro-batches of the hierarchical reduce-scatter (1..4).
    overlap_combine: compute the routed experts in ``num_microbatches`` groups of the local
      experts and overlap each group's reduce-scatter with the next group's expert matmuls
      (``models/moe.py``); each weight is read once, but every group reduce-scatters all rows.
    overlap_split: what ``overlap_combine`` cuts into ``num_microbatches`` micro-batches:
      "experts" (above) or "tokens": this rank's T rows in M chunks of T/M, each chunk's MoE
      (all-gather, routed experts, reduce-scatter of only its D*T/M rows) independent, chunk
      m's reduce-scatter in flight during chunk m + 1's expert matmuls; the reduce-scatter
      bytes are one step's, but every chunk reads the local expert weights again.
    """

    chip_axis: str = CHIP_AXIS
    die_axis: str = DIE_AXIS
    num_microbatches: int = 2
    overlap_combine: bool = False
    overlap_split: str = "experts"

    def __post_init__(self):
        if self.overlap_split not in ("experts", "tokens"):
            raise ValueError(f"overlap_split must be 'experts' or 'tokens', "
                             f"got {self.overlap_split!r}")

    @property
    def axes(self) -> tuple[str, str]:
        return (self.chip_axis, self.die_axis)


@dataclasses.dataclass(frozen=True)
class TPContext:
    """Static description of tensor-parallel attention (``parallel/tp_forward.py``): every
    device of ``axes`` holds a slice of each layer's heads and a share of the routed experts;
    partial outputs are all-reduced over ``axes``."""

    axes: tuple[str, ...] = (CHIP_AXIS, DIE_AXIS)


def make_mesh(dp_size: int, devices: Sequence | None = None, dies_per_chip: int = 2) -> Mesh:
    """A (dp_size / dies, dies) ("chip", "die") mesh over the first ``dp_size`` devices.

    ``dies_per_chip`` is 2 on Ironwood; an odd ``dp_size`` gets one die per chip.
    """
    devices = list(jax.devices() if devices is None else devices)
    if dp_size < 1 or dp_size > len(devices):
        raise ValueError(f"--dp-size {dp_size} needs 1..{len(devices)} devices "
                         f"({len(devices)} visible)")
    dies = dies_per_chip if dp_size % dies_per_chip == 0 else 1
    grid = np.array(devices[:dp_size]).reshape(dp_size // dies, dies)
    return Mesh(grid, (CHIP_AXIS, DIE_AXIS))


def rank_spec(ep: EPContext, dim: int) -> PartitionSpec:
    """Split dimension ``dim`` over all DP/EP ranks, everything else replicated."""
    return PartitionSpec(*([None] * dim), ep.axes)


def canonical_spec(mesh: Mesh, spec: PartitionSpec) -> PartitionSpec:
    """``spec`` without the mesh axes of size 1 (e.g. "chip" of a 1 x 2 mesh): the form XLA
    gives a program's outputs. An array placed with the other, equivalent form has a sharding
    that compares unequal, so the first program it enters compiles a second time."""
    def keep(entry):
        if entry is None:
            return None
        names = [a for a in ((entry,) if isinstance(entry, str) else entry) if mesh.shape[a] > 1]
        return None if not names else names[0] if len(names) == 1 else tuple(names)

    return PartitionSpec(*(keep(e) for e in spec))
