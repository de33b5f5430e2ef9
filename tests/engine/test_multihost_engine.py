"""An engine over 2 processes x 4 CPU devices (``--nnodes 2``) serves like one with 8 devices.

``multihost_engine_run.py`` runs as node 0 (the engine: scheduler, sampling) and node 1 (a
follower running node 0's steps), each with 4 CPU devices and gloo collectives, and, alongside,
as one process with 8 devices and the same flags. Greedy outputs must be identical. The
subprocesses are killed by pid in a ``finally``; the whole run has a deadline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sglang_tpu_backend.server_args import ServerArgs
from tests.cpu_devices import free_port, log_tails, run_peers, run_peers_for_codes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from multihost_engine_run import PROMPT_LENS, REPEATS  # noqa: E402

DEADLINE_S = 300
MISMATCH_DEADLINE_S = 150  # both nodes stop at join: no params loaded, nothing compiled


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost_engine")
    coord = f"127.0.0.1:{free_port()}"
    runs = {"single": (["--single"], 8), 0: ([coord, "2", "0"], 4), 1: ([coord, "2", "1"], 4)}
    run_peers(HERE / "multihost_engine_run.py",
              {k: ([*argv, tmp / f"{k}.json"], devices) for k, (argv, devices) in runs.items()},
              tmp, DEADLINE_S)
    return {k: json.loads((tmp / f"{k}.json").read_text()) for k in runs}


def test_two_processes_serve_the_same_greedy_outputs_as_one(results):
    multi, single = results[0], results["single"]
    assert multi["process_count"] == 2 and multi["local_devices"] == 4
    assert len(multi["outputs"]) == len(PROMPT_LENS)
    for i, (got, want) in enumerate(zip(multi["outputs"], single["outputs"])):
        assert len(got) == 6 + i, (i, got)
        assert got == want, (i, got, want)
    assert multi["stats"]["num_finished_total"] == len(PROMPT_LENS) + len(REPEATS)
    assert multi["stats"]["kv_pages_used"] == 0 and multi["stats"]["state_slots_used"] == 0
    assert multi["router_stats_shape"] == single["router_stats_shape"]
    assert multi["router_stats_shape"][0] == 8  # one row block per DP rank


def test_prefix_cache_hits_across_processes_keep_outputs(results):
    """The leader owns the prefix tree; the followers repeat its GDN snapshot copies, so the
    repeats reuse their cached prefix and still decode what one process decodes."""
    multi, single = results[0]["repeats"], results["single"]["repeats"]
    assert [r["output_ids"] for r in multi] == [r["output_ids"] for r in single]
    assert [r["cached_tokens"] for r in multi] == [r["cached_tokens"] for r in single]
    assert all(r["cached_tokens"] >= 32 for r in multi), multi  # at least one chunk reused


def test_handover_state_moves_to_and_from_either_process(results):
    # Rank 1 lives on node 0, rank 6 on node 1: install and export cross processes there.
    assert results[0]["transfer_round_trip"] == {"1": True, "6": True}
    assert results["single"]["transfer_round_trip"] == {"1": True, "6": True}


def test_follower_ran_every_step_and_stopped(results):
    # The follower ran exactly the leader's steps (no warm-up: skip_warmup) and returned when
    # the leader shut down.
    assert results[1]["steps"] == results[0]["num_steps"] > len(PROMPT_LENS)


def test_weight_update_refused_across_processes(results):
    res = results[0]["weight_update"]
    assert res["success"] is False and "--nnodes" in res["message"], res


def test_nodes_started_with_different_arguments_both_refuse_to_start(tmp_path):
    # Node 1 gets another --page-size: at join both nodes compare their arguments, name the
    # one that differs with both values, leave the group and exit non-zero before the deadline
    # (None would mean still running: a node left waiting in a collective).
    coord = f"127.0.0.1:{free_port()}"
    runs = {0: ([coord, "2", "0", tmp_path / "0.json"], 4),
            1: ([coord, "2", "1", tmp_path / "1.json", "32"], 4)}
    codes = run_peers_for_codes(HERE / "multihost_engine_run.py", runs, tmp_path,
                                MISMATCH_DEADLINE_S, stop_on_failure=False)
    tails = log_tails(runs, tmp_path, codes)
    assert codes[0] not in (None, 0) and codes[1] not in (None, 0), tails
    for k in runs:
        log = (tmp_path / f"{k}.log").read_text()
        assert "MismatchError" in log, tails
        assert (f"node {k}: the nodes' server arguments differ at --page-size "
                f"(node 0: 16, node 1: 32)") in log, tails
    assert not (tmp_path / "0.json").exists() and not (tmp_path / "1.json").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(nnodes=2, dp_size=8, ep_size=8, disable_radix_cache=True), "--dist-init-addr"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank"),
    (dict(nnodes=0), "--nnodes"),
    (dict(nnodes=2, dist_init_addr="h:1", disable_radix_cache=True), "--dp-size"),
])
def test_server_args_reject_unsupported_multihost_setups(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kw)


def test_check_devices_needs_every_device_of_every_node():
    args = ServerArgs(nnodes=2, dist_init_addr="h:1", dp_size=4, ep_size=4,
                      disable_radix_cache=True)
    with pytest.raises(ValueError, match="devices of all nodes"):
        args.check_devices(8, 8)
    args.check_devices(4, 8)


def test_each_process_reads_only_its_devices_weights(results):
    """Each of the two processes read the replicated weights once and the routed experts of
    its own 4 devices (half of them: experts 0-7 on node 0); one 8-device process reads all."""
    ckpt = results[0]["checkpoint"]
    share = ckpt["total"] - ckpt["experts"] // 2
    assert results[0]["bytes_read"] == results[1]["bytes_read"] == share < ckpt["total"]
    assert results[0]["expert_ranges"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert results["single"]["bytes_read"] == ckpt["total"]
