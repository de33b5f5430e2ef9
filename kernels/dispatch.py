"""Choose between a kernel's Pallas TPU implementation, a fast XLA one and the reference.

Every op in ``kernels`` takes a keyword ``impl`` and calls :func:`resolve` at trace time.
``impl`` must be a *static* value of whatever jitted function passes it down (the model
forward takes it as a static argument), so switching implementations retraces instead of
silently reusing a stale compilation.

Values of ``impl``:
  ``"auto"``       Pallas on a TPU backend; elsewhere the op's fast XLA implementation where
                   it has one (grouped matmuls, attention), else its reference (the default).
  ``"pallas"``     always the Pallas kernel, compiled for the TPU.
  ``"interpret"``  the Pallas kernel in TPU interpret mode (runs on CPU; used by tests). With
                   ``STB_INTERPRET_ON_CHIP=1`` on a TPU backend it resolves to ``"pallas"``:
                   the TPU leg of the tests (``tests/run_tpu.sh``) runs every interpret-mode
                   test case compiled by Mosaic and executed on the chip.
  ``"xla"``        the op's fast pure-XLA implementation (grouped matmuls: only the routed
                   rows; attention: only the pages the batch holds; GDN: the reference with
                   CPU-sized chunks); ops without one (their reference already is efficient
                   XLA: routing, collectives) run their reference.
  ``"reference"``  always the pure-JAX reference: the slow, obvious oracle of every op.
"""

from __future__ import annotations

import os
from typing import Literal

import jax

Impl = Literal["auto", "pallas", "interpret", "xla", "reference"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "xla", "reference")

# Process-wide default, so a whole server can be forced onto one path without plumbing:
# STB_KERNEL_IMPL=interpret python -m ...
DEFAULT_IMPL: str = os.environ.get("STB_KERNEL_IMPL", "auto")
# The TPU test leg: "interpret" means the compiled kernel when a chip is there.
INTERPRET_ON_CHIP: bool = os.environ.get("STB_INTERPRET_ON_CHIP", "") == "1"


def resolve(impl: str | None, *, has_xla: bool = False) -> str:
    """Return ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"`` for ``impl``.

    ``has_xla``: the calling op has a fast XLA implementation distinct from its reference
    (then ``"auto"`` off-TPU and ``"xla"`` resolve to ``"xla"``); without one both resolve to
    ``"reference"``.
    """
    impl = DEFAULT_IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "tpu" else "xla"
    elif impl == "interpret" and INTERPRET_ON_CHIP and jax.default_backend() == "tpu":
        impl = "pallas"
    if impl == "xla" and not has_xla:
        return "reference"
    return impl


def interpret_params(resolved: str):
    """The ``interpret=`` argument for ``pl.pallas_call`` given a resolved impl."""
    if resolved != "interpret":
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()
