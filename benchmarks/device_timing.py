"""A jitted call's time on the device, without the host's wait for it.

A call that the host waits for (``block_until_ready``) costs the device's work plus the round
trip in which the host learns that the work finished. On the v5e host this project is measured
on, a call waited for alone measured 0.6-1.1 ms more than the same call timed back to back
(every 397B kernel case timed on 2026-12-07); a 64-request decode attention at 256-token
contexts, whose K/V reads would take ~0.06 ms at the chip's peak, took 0.61 ms waited for.
Inside a step program kernels run back to back and nothing waits between them, so a
kernel's figure should not carry that wait.

``device_ms`` dispatches ``n`` calls back to back and waits once (the device runs one
program after another, in order, so the last call's result is ready only when all are), and
takes away one call waited for alone:

    per call = (t(n back to back) - t(1 waited)) / (n - 1)

The host's round trip is in both terms and cancels; what is left is the device's time per
call, as long as the host dispatches faster than the device runs (a call of a few tens of
microseconds may be paced by its dispatch instead). Where noise makes the difference
non-positive (the CPU, whose calls are synchronous), t(n) / n is used.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def waited_ms(dispatch: Callable[[], Any]) -> float:
    """Milliseconds of one call, dispatched and waited for."""
    t0 = time.perf_counter()
    jax.block_until_ready(dispatch())
    return 1e3 * (time.perf_counter() - t0)


def back_to_back_ms(dispatch: Callable[[], Any], n: int) -> float:
    """Milliseconds of ``n`` calls dispatched back to back and waited for once, at the last
    (a donated output fed to the next call cannot be waited for: it is gone)."""
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = dispatch()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0)


def device_ms(dispatch: Callable[[], Any], n: int, rounds: int = 3) -> tuple[float, float, float]:
    """(median, min) of the device's milliseconds per call over ``rounds`` runs of ``n >= 2``
    calls back to back (module doc), and the median of ``rounds`` calls waited for alone."""
    if n < 2:
        raise ValueError(f"device_ms needs n >= 2 calls back to back, got {n}")
    waited = statistics.median(waited_ms(dispatch) for _ in range(rounds))
    per_call = []
    for _ in range(rounds):
        total = back_to_back_ms(dispatch, n)
        net = (total - waited) / (n - 1)
        per_call.append(net if net > 0 else total / n)
    return statistics.median(per_call), min(per_call), waited
