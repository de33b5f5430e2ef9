"""Cost models: what a kernel call moves and computes, as a function of its shapes.

Each kernel module exposes ``<op>_cost(...) -> Cost`` next to the kernel. The numbers are
analytic (no profiling): FLOPs count a multiply-add as 2, bytes count every HBM read and write
the kernel needs at least once. They feed ``pl.CostEstimate`` and the roofline tool.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: int  # floating-point operations (multiply-add = 2)
    bytes_accessed: int  # HBM bytes read + written
    transcendentals: int = 0  # exp / log / rsqrt / sigmoid evaluations
    remote_bytes: int = 0  # bytes sent to other devices (remote DMA)

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.flops + other.flops,
            self.bytes_accessed + other.bytes_accessed,
            self.transcendentals + other.transcendentals,
            self.remote_bytes + other.remote_bytes,
        )

    def arithmetic_intensity(self) -> float:
        """FLOPs per HBM byte."""
        return self.flops / max(self.bytes_accessed, 1)

    def to_pallas(self):
        """As a ``pl.CostEstimate`` for ``pallas_call(cost_estimate=...)``."""
        from jax.experimental import pallas as pl

        return pl.CostEstimate(
            flops=int(self.flops),
            bytes_accessed=int(self.bytes_accessed),
            transcendentals=int(self.transcendentals),
            remote_bytes_transferred=int(self.remote_bytes),
        )
