"""An Engine with --dp-size 8 --ep-size 8 (8 simulated CPU devices) serves exactly what a
--dp-size 1 engine serves, spreads the requests over every rank and ends with empty pools.

The device count is fixed before jax starts, so ``dp_engine_run.py`` runs both engines in a
subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=8) and writes JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cpu_devices import run_on_cpu_devices

from sglang_tpu_backend.server_args import ServerArgs

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_engine") / "out.json"
    run_on_cpu_devices(HERE / "dp_engine_run.py", str(out))
    return json.loads(out.read_text())


def test_dp8_outputs_equal_dp1(results):
    dp, ref = results["dp_outputs"], results["ref_outputs"]
    assert len(dp) == 24 and all(len(o) == 8 for o in ref)
    for i, (a, b) in enumerate(zip(dp, ref)):
        assert a == b, (i, a, b)


def test_tp4_outputs_equal_dp1_and_pools_are_empty(results):
    tp, ref = results["tp_outputs"], results["ref_outputs"]
    assert len(tp) == 24
    for i, (a, b) in enumerate(zip(tp, ref)):
        assert a == b, (i, a, b)
    stats = results["tp_stats"]
    assert (stats["kv_pages_used"], stats["state_slots_used"], stats["num_running"]) == (0, 0, 0)
    assert stats["num_finished_total"] == 24


def test_weight_update_with_dp_and_tp(results):
    """Both engines swap in another checkpoint (placed in their own shardings) and back: the
    new weights give the same outputs on DP and TP, different from the old ones; the warmed-up
    DP engine compiles nothing for them; back on the old weights the outputs are the first ones."""
    dp, tp = results["dp_update"], results["tp_update"]
    assert dp["new_outputs"] == tp["new_outputs"] != results["dp_outputs"]
    assert dp["new_lowerings"] == 0
    assert dp["old_outputs"] == results["dp_outputs"] and tp["old_outputs"] == results["tp_outputs"]
    for stats in (dp["stats"], tp["stats"]):
        assert (stats["kv_pages_used"], stats["state_slots_used"], stats["num_running"]) == (0, 0, 0)


def test_every_rank_got_work_and_pools_are_empty(results):
    stats = results["dp_stats"]
    ranks = stats["dp_ranks"]
    assert len(ranks) == 8
    assert all(r["num_admitted_total"] > 0 for r in ranks), ranks
    assert sum(r["num_admitted_total"] for r in ranks) >= 24
    for r in ranks:
        assert (r["kv_pages_used"], r["state_slots_used"], r["num_running"]) == (0, 0, 0), r
        assert (r["kv_pages_total"], r["state_slots_total"]) == (32, 4)  # host totals / 8
    assert (stats["kv_pages_used"], stats["state_slots_used"], stats["num_queued"]) == (0, 0, 0)
    assert (stats["kv_pages_total"], stats["state_slots_total"]) == (256, 32)
    assert stats["num_finished_total"] == 24 and stats["num_aborted_total"] == 0
    assert "dp_ranks" in results["dp_server_info_keys"]


def test_dp_steps_use_warmed_up_shapes(results):
    warm = {tuple(s) for s in results["dp_warm_shapes"]}
    assert {s[0] for s in warm} == {"DECODE", "MIXED"}  # EXTEND steps run as MIXED
    assert results["dp_step_shapes"]
    for shape in results["dp_step_shapes"]:
        assert tuple(shape) in warm, shape


@pytest.mark.parametrize("kwargs,flag", [
    (dict(dp_size=8, ep_size=4), "--ep-size must equal --dp-size"),
    (dict(dp_size=1, ep_size=2), "--ep-size must equal --dp-size"),
    (dict(tp_size=8, dp_size=8, ep_size=8), "not both"),
    (dict(tp_size=4, ep_size=2), "--ep-size must equal --tp-size"),
    (dict(dp_size=0, ep_size=0), "--dp-size"),
    (dict(dp_size=8, ep_size=8, max_running_requests=4), "--max-running-requests"),
    (dict(dp_size=8, ep_size=8, max_total_tokens=64, page_size=16), "--max-total-tokens"),
])
def test_parallel_flags_rejected_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs)


def test_parallel_sizes_checked_against_devices_and_experts():
    args = ServerArgs(dp_size=8, ep_size=8)
    args.check_devices(num_devices=8, num_experts=16)
    with pytest.raises(ValueError, match="--dp-size 8 needs 8 devices, 1 visible"):
        args.check_devices(num_devices=1, num_experts=16)
    with pytest.raises(ValueError, match="--ep-size 8 must divide"):
        args.check_devices(num_devices=8, num_experts=12)
    tp = ServerArgs(tp_size=4)
    assert tp.ep_size == 4  # experts split over the tensor-parallel devices
    with pytest.raises(ValueError, match="--tp-size 4 needs 4 devices, 2 visible"):
        tp.check_devices(num_devices=2, num_experts=16)


def test_dp4_engine_reads_each_devices_share_and_serves_as_the_whole_load(results):
    """A --dp-size 4 engine loads the per-expert FP8 checkpoint shard by shard: every device
    read exactly its quarter of the routed experts' bytes (its own 4 of 16 experts), the
    process read every tensor once, and it serves what the DP8 engine serves on the same
    checkpoint loaded whole on the host and then placed (its weight update)."""
    r = results["dp4_sharded"]
    assert r["expert_ranges"] == [[0, 4], [4, 8], [8, 12], [12, 16]]
    assert r["expert_bytes"] == [r["experts"] // 4] * 4 and r["experts"] % 4 == 0
    assert r["bytes_read"] == r["total"]
    assert r["outputs"] == results["dp_update"]["new_outputs"]


def test_dummy_load_format_serves_the_seeds_weights(results):
    r = results["dummy"]
    assert r["bytes_read"] == 0 and r["params_reproduced"]
    assert len(r["outputs"]) == 24 and all(len(o) == 8 for o in r["outputs"])
    assert r["outputs"] != results["ref_outputs"]
