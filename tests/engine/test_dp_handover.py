"""Prefill on a --dp-size 4 engine (and on a --tp-size 4 one), decode on a --dp-size 2 engine
(8 simulated CPU devices):
the same tokens and logprobs as one single-device engine, the request state moved rank to
rank, every rank's pages and slots free afterwards, and no handover program compiled while
serving (``dp_handover_run.py`` runs the engines in a subprocess and writes JSON). Under
NEXTN the MTP KV moves rank to rank too: DP -> DP, one device -> DP and DP -> one device give
the same outputs, and every decode side holds the drafts a one-device NEXTN engine proposes;
a weight update of the NEXTN DP engine swaps its MTP params.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.cpu_devices import run_on_cpu_devices

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_handover") / "out.json"
    run_on_cpu_devices(HERE / "dp_handover_run.py", str(out))
    return json.loads(out.read_text())


def test_dp4_prefill_to_dp2_decode_equals_one_engine(results):
    pd, ref = results["pd_outputs"], results["ref_outputs"]
    assert len(pd) == len(ref) == 24
    for i, (a, b) in enumerate(zip(pd, ref)):
        assert a["ids"] == b["ids"], (i, a["ids"], b["ids"])
        assert a["finish"] == b["finish"] == {"type": "length", "length": 8}
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, err_msg=str(i))


def test_tp4_prefill_to_dp2_decode_equals_one_engine(results):
    """A tensor-parallel prefill (kv heads and GDN key channels replicated over its devices)
    hands over whole heads in the model's order: the same tokens and logprobs."""
    tp, ref = results["tp_outputs"], results["ref_outputs"]
    for i, (a, b) in enumerate(zip(tp, ref)):
        assert a["ids"] == b["ids"], (i, a["ids"], b["ids"])
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, err_msg=str(i))
    s = results["tp_stats"]
    assert (s["kv_pages_used"], s["state_slots_used"], s["num_aborted_total"]) == (0, 0, 0), s


def test_every_rank_served_and_ends_empty(results):
    for name, ranks in (("prefill_stats", 4), ("decode_stats", 2)):
        stats = results[name]
        assert len(stats["dp_ranks"]) == ranks
        for r in stats["dp_ranks"]:
            assert r["num_admitted_total"] > 0, (name, r)  # placed by load on every rank
            assert (r["kv_pages_used"], r["state_slots_used"], r["num_running"]) == (0, 0, 0), r
        assert stats["num_aborted_total"] == 0 and stats["num_queued"] == 0, stats
    assert results["decode_stats"]["num_finished_total"] == 48  # (prefill: exported, not finished)


def test_handover_programs_compiled_at_warm_up(results):
    """One export and one install program per page-count bucket, all compiled before serving:
    serving adds none. Buckets 1..16 pages at 256 tokens of 16; the NEXTN prefill's requests
    hold pages for k = 3 positions past the context, hence one more bucket (32)."""
    assert results["programs_after_warmup"] == [6, 5]
    assert results["programs_after_serving"] == results["programs_after_warmup"]


def assert_same_outputs(got, want, n):
    assert len(got) == len(want) == n
    for i, (a, b) in enumerate(zip(got, want)):
        assert a["ids"] == b["ids"], (i, a["ids"], b["ids"])
        assert a["finish"] == b["finish"] == {"type": "length", "length": 8}
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, err_msg=str(i))


@pytest.mark.parametrize("run, n", [("nextn_dp_to_dp", 48), ("nextn_one_to_dp", 8),
                                    ("nextn_dp_to_one", 8), ("nextn_alone", 48)])
def test_nextn_handover_with_dp_equals_one_engine(results, run, n):
    """NEXTN prefill -> NEXTN decode with --dp-size on either side: the plain one-engine
    tokens and logprobs; the decode side verifies drafts (random MTP weights: mostly
    rejected, so the back-off may pause a request; most verify at least once)."""
    got = results[run]
    assert_same_outputs(got, results["nextn_ref_outputs"][:n], n)
    verified = [g["verify_ct"] > 0 for g in got]
    assert sum(verified) > n // 2, verified


def test_nextn_dp_decode_drafts_equal_the_one_device_engines(results):
    """The MTP drafts a NEXTN DP2 decode replica holds at every proposal (the first: the
    handover's; later: its MTP layer over the MTP KV installed on the request's rank) equal
    the drafts a one-device NEXTN engine holds serving the same requests alone, at the same
    sequence; so do the one-device decode side's after a DP4 prefill. A step whose requests
    were all in a back-off pause ran no draft chain and left none (``[]``): which steps those
    are depends on the batch, so only proposals where both engines hold drafts compare."""
    alone = results["nextn_drafts"]["one"]["d"]
    for side, tag, n in (("dp2", "a", 48), ("dp2", "b", 8), ("one", "c", 8)):
        seen = results["nextn_drafts"][side][tag]
        first = {}
        for key in seen:
            i, length = key.split("/")
            first[i] = min(first.get(i, 1 << 30), int(length))
        assert len(first) == n, (side, tag, sorted(first))  # every request verified
        shared = [k for k in seen if alone.get(k) and seen[k]]
        assert {f"{i}/{length}" for i, length in first.items()} <= set(shared), (side, tag)
        assert len(shared) >= 2 * n, (side, tag, len(shared))
        differ = [k for k in shared if seen[k] != alone[k]]
        assert differ == [], (side, tag, differ[:5])


def test_nextn_dp_decode_uses_every_rank_and_compiles_no_mtp_install(results):
    s = results["nextn_decode_stats"]
    assert [r["num_admitted_total"] > 0 for r in s["dp_ranks"]] == [True, True], s
    for r in s["dp_ranks"]:
        assert (r["kv_pages_used"], r["state_slots_used"], r["num_running"]) == (0, 0, 0), r
    assert s["num_aborted_total"] == 0 and s["num_finished_total"] == 56, s
    warm, served = results["nextn_mtp_install_programs"]
    assert warm == 6 and served == warm  # one per page bucket, 1..32 (see above)


def test_nextn_dp_weight_update_swaps_the_mtp_params(results):
    """A weight update of the NEXTN DP2 engine (weights of another seed) places the new
    checkpoint's MTP params on the ranks as the startup ones were and serves them."""
    assert results["nextn_dp_weight_update"] == {"success": True, "mtp_params_equal": True}
