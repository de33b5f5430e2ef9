"""benchmarks/device_timing.py on a simulated device with a fake clock: a call's device time is
recovered without the host's round trip, which a call waited for alone includes."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

DEVICE_MS, ROUND_TRIP_MS = 1.3, 0.45


class FakeChip:
    """Calls queue up on one in-order device; waiting costs the round trip once the device
    is done. Dispatch itself costs the host ``dispatch_ms``."""

    def __init__(self, dispatch_ms=0.02):
        self.now = 0.0  # ms, the host's clock
        self.device_free = 0.0  # ms at which the device finishes what is queued
        self.dispatch_ms = dispatch_ms

    def clock(self):
        return self.now / 1e3

    def dispatch(self):
        self.now += self.dispatch_ms
        self.device_free = max(self.device_free, self.now) + DEVICE_MS
        return self.device_free

    def wait(self, done_at):
        self.now = max(self.now, done_at) + ROUND_TRIP_MS
        return done_at


@pytest.fixture
def timing(monkeypatch):
    mod, chip = load_script("benchmarks/device_timing.py"), FakeChip()
    monkeypatch.setattr(mod.time, "perf_counter", chip.clock)
    monkeypatch.setattr(mod.jax, "block_until_ready", chip.wait)
    return mod, chip


def test_device_ms_takes_the_round_trip_away(timing):
    mod, chip = timing
    med, fastest, waited = mod.device_ms(chip.dispatch, n=10)
    assert med == pytest.approx(DEVICE_MS, rel=1e-6) and fastest == pytest.approx(DEVICE_MS)
    assert waited == pytest.approx(chip.dispatch_ms + DEVICE_MS + ROUND_TRIP_MS)
    # n calls back to back, waited for once: the round trip amortised, not gone
    assert mod.back_to_back_ms(chip.dispatch, 4) / 4 > DEVICE_MS + ROUND_TRIP_MS / 4 - 1e-9


def test_device_ms_needs_two_calls(timing):
    mod, chip = timing
    with pytest.raises(ValueError, match="n >= 2"):
        mod.device_ms(chip.dispatch, n=1)
