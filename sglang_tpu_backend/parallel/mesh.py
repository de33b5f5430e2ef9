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

    (The MoE combine overlapped with the expert matmuls, by expert groups or token chunks, was
    measured slower than this synchronous combine at every 397B shape and is gone: README,
    "Overlap of the combine with the expert matmuls".)
    """

    chip_axis: str = CHIP_AXIS
    die_axis: str = DIE_AXIS
    num_microbatches: int = 2

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
