"""DP=8 attention + EP=8 experts on 8 simulated CPU devices equal single-device generation.

The run needs 8 devices, which must be fixed before jax starts, so ``dp_ep_run.py`` runs in a
subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=8) and writes an .npz; the tests
assert on it. Every request is compared with the same request run alone on one device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cpu_devices import run_on_cpu_devices

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_ep") / "out.npz"
    run_on_cpu_devices(HERE / "dp_ep_run.py", str(out))
    return dict(np.load(out))


def test_mesh_is_four_chips_by_two_dies(results):
    assert results["mesh_shape"].tolist() == [4, 2]


def test_greedy_tokens_equal_single_device(results):
    n = int(results["num_requests"])
    assert n == 11
    for i in range(n):
        dp, ref = results[f"dp_tokens_{i}"], results[f"ref_tokens_{i}"]
        assert len(dp) >= 4 and dp.tolist() == ref.tolist(), (i, dp, ref)


def test_logits_within_tolerance(results):
    for i in range(int(results["num_requests"])):
        dp, ref = results[f"dp_logits_{i}"], results[f"ref_logits_{i}"]
        assert dp.shape == ref.shape
        np.testing.assert_allclose(dp, ref, atol=1e-4, rtol=0, err_msg=f"request {i}")
