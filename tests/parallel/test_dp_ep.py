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


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("run", ["permuted", "rebalanced"])
def test_eplb_placements_keep_outputs(results, run):
    """Experts in 24 physical slots (8 redundant copies) of a permuted placement, or of the
    trivial one rebalanced in mid-run: float32 greedy tokens identical to the run of the
    logical experts as loaded (identity), logprobs within 1e-5."""
    for i in range(int(results["num_requests"])):
        base = results[f"dp_tokens_{i}"]
        assert results[f"{run}_tokens_{i}"].tolist() == base.tolist(), (run, i)
        np.testing.assert_allclose(_log_softmax(results[f"{run}_logits_{i}"]),
                                   _log_softmax(results[f"dp_logits_{i}"]), atol=1e-5, rtol=0,
                                   err_msg=f"{run} request {i}")
    first, last = results[f"{run}_first_location"], results[f"{run}_last_location"]
    if run == "permuted":  # every layer's placement differs from the trivial one
        assert first.shape == (8, 24) and (first != np.arange(24) % 16).any(axis=1).all()
        assert (last == first).all() and int(results["permuted_rebalances"]) == 0
    else:  # trivial at first (slot p holds expert p mod 16), another placement after
        assert first.shape == last.shape == (8, 24) and (first == np.arange(24) % 16).all()
        assert int(results["rebalanced_rebalances"]) == 1 and (last != first).any()


def test_eplb_rebalance_evens_a_skewed_router(results):
    """A router favouring experts 9-11 (all on rank 3 at first): the rows each EP rank's slots
    receive, max / mean per layer, drop after a rebalance from the recorded loads; the tokens
    of the two runs are the same."""
    before, after = results["skew_ratio_before"], results["skew_ratio_after"]
    print(f"per-EP-rank routed rows max/mean per layer: before {np.round(before, 3).tolist()} "
          f"after {np.round(after, 3).tolist()}")
    loads = results["skew_logical_loads"]  # [layers, 16]
    assert (loads[:, 9:12].min(axis=1) > np.delete(loads, [9, 10, 11], axis=1).max(axis=1)).all()
    assert before.min() > 1.8 and after.max() < 1.25 and (after < before).all()
    assert (results["skew_tokens_before"] == results["skew_tokens_after"]).all()
