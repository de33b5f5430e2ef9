"""Prefill on a --dp-size 4 engine (and on a --tp-size 4 one), decode on a --dp-size 2 engine
(8 simulated CPU devices):
the same tokens and logprobs as one single-device engine, the request state moved rank to
rank, every rank's pages and slots free afterwards, and no handover program compiled while
serving (``dp_handover_run.py`` runs the engines in a subprocess and writes JSON).
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
    """One export and one install program per page-count bucket (1..16 pages at 256 tokens of
    16), all compiled before serving: serving adds none."""
    assert results["programs_after_warmup"] == [5, 5]
    assert results["programs_after_serving"] == results["programs_after_warmup"]
