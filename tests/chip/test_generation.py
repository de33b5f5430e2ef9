"""On a chip the backend finds its TPU generation's peaks (device_kind)."""

import jax
import pytest

pytestmark = pytest.mark.chip


def test_this_hardware_is_the_chips_generation():
    from sglang_tpu_backend.planning import roofline

    kind = jax.devices()[0].device_kind
    hw = roofline.this_hardware()
    assert hw.name == roofline.DEVICE_KINDS[kind]
    assert hw.hbm_bytes >= jax.devices()[0].memory_stats()["bytes_limit"]
