"""ForwardMode: what kind of step the model runs (SGLang's names). Plain Python, so the
scheduler can use it without importing JAX."""

from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    """What kind of step this is. Static in the jitted forward: each mode compiles once."""

    EXTEND = 1  # prefill chunks only
    DECODE = 2  # exactly one new token per request: the GDN layers take the recurrent path
    MIXED = 3  # prefill chunks and decode tokens together
    IDLE = 4  # nothing to run on this DP rank (keeps collectives in step)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE
