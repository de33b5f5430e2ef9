"""Two processes forming one 8-device mesh run DP x EP generation like one process does.

``multihost_run.py`` runs in 2 processes (4 CPU devices each, gloo collectives, a free local
port for the coordinator): process 0 leads (schedules, broadcasts the rank batches, samples),
process 1 follows. Its greedy tokens and logits are compared with ``multihost_run.py --single``
run alongside: the same plan in ONE process with 8 devices (the code path of ``dp_ep_run.py``,
bit-identical to it) and every request run alone on one device. The subprocesses are killed
by pid in a ``finally`` and the whole run has a deadline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.parallel import multihost as mh
from tests.cpu_devices import free_port, run_peers

HERE = Path(__file__).resolve().parent
NUM_PROCESSES = 2
DEADLINE_S = 300  # the whole fixture: ~40 s of CPU per process, ~1-2 min on 2 busy cores


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    mh_out, single_out = tmp / "multihost.npz", tmp / "single.npz"
    coordinator = f"127.0.0.1:{free_port()}"
    # One process with 8 devices (the same plan, plus every request alone), alongside.
    runs = {"single": (["--single", single_out], 8)}
    for pid in range(NUM_PROCESSES):
        runs[pid] = ([coordinator, NUM_PROCESSES, pid, mh_out], 4)
    run_peers(HERE / "multihost_run.py", runs, tmp, DEADLINE_S)
    return dict(np.load(mh_out)), dict(np.load(single_out))


def test_mesh_spans_both_processes(results):
    multi, single = results
    assert int(multi["process_count"]) == NUM_PROCESSES and int(single["process_count"]) == 1
    assert multi["mesh_shape"].tolist() == single["mesh_shape"].tolist() == [4, 2]
    # chips 0-1 are process 0's devices, chips 2-3 process 1's
    assert multi["mesh_process"].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_plan_has_prefill_decode_and_mixed_steps(results):
    multi, _ = results
    modes = multi["step_modes"].tolist()
    assert len(modes) == 7 and modes == results[1]["step_modes"].tolist()
    assert modes[0] == ForwardMode.EXTEND and ForwardMode.DECODE in modes
    assert modes.count(ForwardMode.EXTEND) == 2  # the prefill and the late request's step


def test_greedy_tokens_equal_one_process_and_alone(results):
    multi, single = results
    n = int(multi["num_requests"])
    assert n == int(single["num_requests"]) == 11
    for i in range(n):
        got = multi[f"dp_tokens_{i}"].tolist()
        assert len(got) >= 4
        assert got == single[f"dp_tokens_{i}"].tolist(), (i, got, single[f"dp_tokens_{i}"])
        assert got == single[f"ref_tokens_{i}"].tolist(), (i, got, single[f"ref_tokens_{i}"])


def test_logits_within_tolerance(results):
    multi, single = results
    for i in range(int(multi["num_requests"])):
        got = multi[f"dp_logits_{i}"]
        for ref in ("dp", "ref"):
            want = single[f"{ref}_logits_{i}"]
            assert got.shape == want.shape, (i, ref)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"request {i} {ref}")


# Single-process checks of the protocol pieces (no distributed init needed) ---------------------
def _rank_batches(T=16, R=4, P=3, L=4):
    out = []
    for k in range(3):
        chunks = [SeqChunk(list(range(1 + k, 4 + k)), 0, [0, 1, 2], 0)] if k != 1 else []
        out.append(build_forward_batch(chunks, page_size=4, mode=ForwardMode.EXTEND,
                                       num_tokens=T, num_seqs=R, pages_per_seq=P,
                                       num_logits=L)[0])
    return out


def test_broadcast_step_round_trips_batches():
    batches = _rank_batches()
    got = mh.broadcast_step(batches, 3)  # one process: the leader receives its own step
    assert len(got) == 3
    for b, g in zip(batches, got):
        assert g.mode == b.mode
        for name in mh._FIELDS:
            np.testing.assert_array_equal(getattr(g, name), getattr(b, name))
    assert mh.broadcast_step(None, 3) is None  # stop


def test_broadcast_step_rejects_mixed_buckets():
    batches = _rank_batches()
    batches[2] = _rank_batches(T=32)[2]
    with pytest.raises(ValueError, match="one bucket"):
        mh.broadcast_step(batches, 3)
    with pytest.raises(ValueError, match="3 rank batches"):
        mh.broadcast_step(batches[:2], 3)


@pytest.mark.parametrize("args, match", [
    (("localhost", 2, 0), "host:port"),
    (("127.0.0.1:1234", 0, 0), "num_processes"),
    (("127.0.0.1:1234", 2, 2), "process_id"),
])
def test_initialize_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        mh.initialize(*args, cpu_collectives=True)


def test_agreement_items_name_what_differs():
    from sglang_tpu_backend.parallel import agreement
    from sglang_tpu_backend.server_args import ServerArgs
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    base = dict(model_path=str(default_model_path()), nnodes=2, dist_init_addr="h:1",
                dp_size=8, ep_size=8, disable_radix_cache=True)
    a = agreement.server_arg_items(ServerArgs(**base))
    assert "model.hidden_size" in a and "--page-size" in a and "--kernel-impl" in a
    assert agreement.describe_mismatch("server arguments", [a, dict(a)]) is None
    # "auto" resolves to the checkpoint's dtype: the same served dtype agrees
    resolved = agreement.server_arg_items(ServerArgs(**base, dtype="auto"))["--dtype"]
    explicit = agreement.server_arg_items(ServerArgs(**base, dtype=json.loads(resolved)))
    assert explicit["--dtype"] == resolved
    b = agreement.server_arg_items(ServerArgs(**base, page_size=32, max_running_requests=32))
    msg = agreement.describe_mismatch("server arguments", [a, b])
    assert "differ at --max-running-requests (node 0: 64, node 1: 32)" in msg  # first in order
    experts = a["model.num_experts"]
    c = dict(a, **{"model.num_experts": str(2 * int(experts))})
    assert (f"at model.num_experts (node 0: {experts}, node 1: {experts}, "
            f"node 2: {2 * int(experts)})") in agreement.describe_mismatch("x", [a, a, c])


def test_param_agreement_names_the_first_differing_param():
    import jax.numpy as jnp

    from sglang_tpu_backend.parallel import agreement

    params = {"embed": np.zeros((8, 4), np.float32), "layers": [{"w": jnp.zeros((4, 4), jnp.bfloat16)}]}
    a = agreement.param_items(params)
    assert a == {"['embed']": "[8, 4] float32", "['layers'][0]['w']": "[4, 4] bfloat16"}
    b = agreement.param_items({**params, "layers": [{"w": np.zeros((4, 4), np.float32)}]})
    assert agreement.describe_mismatch("parameters", [a, b]) == (
        "the nodes' parameters differ at ['layers'][0]['w'] (node 0: [4, 4] bfloat16, "
        "node 1: [4, 4] float32); start every node with the same model and the same arguments")
    c = {k: v for k, v in a.items() if k != "['embed']"}
    assert "['embed'] (node 0: [8, 4] float32, node 1: <missing>)" in \
        agreement.describe_mismatch("parameters", [a, c])


def test_agreement_of_one_process_passes():
    from sglang_tpu_backend.parallel import agreement

    agreement.require_agreement("parameters", {"w": "[2] float32"})  # one process: no peers
