"""Block sizes per TPU generation: the table in ``block_tables.json`` and its run-time lookup.

Each kernel derives its block sizes from the shapes (``GdnBlockSizes``' smallest lane-aligned
head block and decode rows per grid step, ``gmm.default_block_sizes``, ``RoutingBlockSizes()``,
attention's ``BlockSizes.get_default``). The table holds, per JAX ``device_kind`` ("TPU v5
lite" = v5e, "TPU v6 lite" = v6e, "TPU7x" = Ironwood) and per kernel, field overrides applied
on top of those defaults, each entry with its provenance::

    {"overrides": {"kv_pages_per_block": 4}, "timed": true,
     "source": "benchmarks/sweep_block_sizes.py on TPU v5 lite, 397b preset, <date>", ...}

``timed: false`` entries come from a compile sweep (libtpu on a machine without the chip):
they record which candidates compiled and their VMEM, and keep ``overrides`` empty, since an
untimed choice must not change what runs. ``benchmarks/sweep_block_sizes.py`` regenerates
the entries of the chip it runs on.

When a caller passes no block sizes, a kernel wrapper calls :func:`pick` once (one seam per
kernel): off a TPU (the CPU, interpret mode) there are no overrides, and an override that is
illegal for the call's shapes falls back to the shape default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, TypeVar

import jax

TABLE_PATH = Path(__file__).with_name("block_tables.json")
# The kernels of the table and the block-size fields each may override.
FIELDS = {
    "attention": ("decode_q_tokens", "prefill_q_tokens", "kv_pages_per_block"),
    "gdn": ("k_heads_per_block", "rows_per_step"),
    "gmm": ("tm", "tk", "tn"),
    "routing": ("gather_rows", "reduce_tokens"),
}
# Other spellings of a device kind (as planning/roofline.py's DEVICE_KINDS accepts them).
ALIASES = {"TPU v5e": "TPU v5 lite", "TPU v6e": "TPU v6 lite", "TPU 7x": "TPU7x"}

_state = {"enabled": True}
B = TypeVar("B")


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(TABLE_PATH)) -> dict:
    """The table file's ``device_kinds`` mapping: device kind -> kernel -> entry."""
    return json.loads(Path(path).read_text())["device_kinds"]


def current_device_kind() -> str | None:
    """The device kind of this process's default backend, or None off a TPU."""
    dev = jax.devices()[0]
    return dev.device_kind if dev.platform == "tpu" else None


def entry(kernel: str, device_kind: str | None) -> dict | None:
    """The table's entry for ``kernel`` on ``device_kind`` (None: none, or off a TPU)."""
    if kernel not in FIELDS:
        raise ValueError(f"unknown kernel {kernel!r} (known: {sorted(FIELDS)})")
    if device_kind is None:
        return None
    return load_table().get(ALIASES.get(device_kind, device_kind), {}).get(kernel)


def overrides(kernel: str, device_kind: str | None) -> dict:
    """The block-size fields the table sets for ``kernel`` on ``device_kind`` ({} if none)."""
    e = entry(kernel, device_kind)
    return dict(e.get("overrides", {})) if e else {}


def apply(default: B, over: dict, legal: Callable[[B], bool]) -> B:
    """``default`` with the fields of ``over`` replaced, if ``legal`` accepts the result;
    otherwise ``default`` unchanged (an override never makes a call fail)."""
    if not over:
        return default
    picked = dataclasses.replace(default, **over)
    return picked if legal(picked) else default


def pick(kernel: str, default: B, legal: Callable[[B], bool]) -> B:
    """The block sizes a wrapper uses when its caller passed none: ``default`` (the shape's)
    with this device kind's table overrides where legal."""
    if not _state["enabled"]:
        return default
    return apply(default, overrides(kernel, current_device_kind()), legal)


@contextlib.contextmanager
def disabled():
    """Within: every kernel uses its shape defaults (the sweep's baseline)."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before
