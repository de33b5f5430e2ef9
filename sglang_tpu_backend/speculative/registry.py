"""The drafter of each ``--speculative-algorithm``: above the drafters (which share
``drafter.py``'s protocol and back-off), so that no drafter module imports another."""

from __future__ import annotations

from sglang_tpu_backend.speculative.drafter import Drafter
from sglang_tpu_backend.speculative.nextn import NextnDrafter
from sglang_tpu_backend.speculative.ngram import NgramDrafter


def make_drafter(algorithm: str, *, min_window: int, max_window: int) -> Drafter:
    """The drafter of ``--speculative-algorithm`` (validated by ``ServerArgs``)."""
    if algorithm == "NGRAM":
        return NgramDrafter(min_window, max_window)
    if algorithm in ("NEXTN", "EAGLE"):
        return NextnDrafter()
    raise ValueError(f"no drafter for --speculative-algorithm {algorithm}")
