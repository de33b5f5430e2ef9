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
    # Speculative verification: every request has exactly n = k+1 tokens (its last token and
    # k drafts); attention writes KV for all of them, the GDN layers leave their slots as they
    # were and return the state after every position (``model_executor/verify.py``).
    TARGET_VERIFY = 5

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY
