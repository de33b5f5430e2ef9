"""The Ray rollout group (``ray_app/rollout.py``) and the RL loop example (``examples/rl_loop.py``).

Each Ray cluster here is local, bound to 127.0.0.1, with a temp dir of its own under /tmp; when
it is shut down no process whose command line names that dir may remain (Ray's gcs, raylet,
workers and agents all carry it).

- The example, run as a script for 2 steps (2 replicas, 2 prompts x 2 samples, one seed for
  every step): every step's largest |rollout - trainer| token logprob is 0 (the f32 target
  is <= 1e-5; the trainer replays the deterministic engines' schedule, so it rounds as they
  do: ``test_rl_scoring.py``), the rollouts' weight version goes ``default`` -> ``step-1``,
  the refit changes the logprobs of the same sampled tokens, and the cluster's processes are
  gone after it exits.
- A group of 2 f32 replicas: per prompt its n samples in order (sample j == a lone sample
  with seed + j, prompts told apart by length), a release / resume of weights and KV cache
  leaves greedy outputs and logprobs as they were, a pause with ``abort`` ends a rollout in
  flight on both replicas with finish_reason abort and ``continue_generation`` serves again,
  and an error in a replica or a refused refit raises naming the replica.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
ENV = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
ENGINE_ARGS = dict(dtype="float32", page_size=16, context_length=128, chunked_prefill_size=64,
                   max_running_requests=16, skip_warmup=True, random_seed=0, log_level="warning")
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [100, 200, 300, 400, 500, 600, 700, 800, 900]]


def _ray_pids(temp_dir: str) -> list[int]:
    """Processes whose command line names ``temp_dir``."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if temp_dir.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


def _assert_no_ray_left(temp_dir: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := _ray_pids(temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left running: {left}"


def test_rl_loop_example(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="ray_rl_", dir="/tmp")  # short: Ray's socket paths
    out = tmp_path / "records.json"
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / "rl_loop.py"), "--steps", "2",
             "--replicas", "2", "--prompts", "2", "--n", "2", "--max-new-tokens", "8",
             "--fixed-seed", "--temp-dir", temp_dir, "--out", str(out)],
            env={**os.environ, **ENV}, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        records = json.loads(out.read_text())
        assert [r["step"] for r in records] == [0, 1]
        for r in records:
            assert r["max_gap"] == 0.0, r  # the replay: the engines' own rounding
        assert [r["weight_versions"] for r in records] == [["default"], ["step-1"]]
        # The same draws (one seed): the refit is what moves the logprobs.
        assert records[0]["output_ids0"] == records[1]["output_ids0"]
        gap = np.abs(np.subtract(records[0]["logprobs0"], records[1]["logprobs0"])).max()
        assert gap > 1e-3, f"the refit did not change the rollout's logprobs ({gap})"
        assert "step 1: rollout" in proc.stdout
        _assert_no_ray_left(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def group():
    from ray_app.rollout import RolloutGroup

    temp_dir = tempfile.mkdtemp(prefix="ray_rg_", dir="/tmp")
    os.environ.update(ENV)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, runtime_env={"env_vars": ENV})
    g = None
    try:
        g = RolloutGroup(2, ENGINE_ARGS, num_cpus=1, env=ENV)
        yield g
    finally:
        try:
            if g is not None:
                g.shutdown()
        finally:
            ray.shutdown()
            _assert_no_ray_left(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _ids_and_logprobs(groups):
    return [[(s["output_ids"], [e[0] for e in s["meta_info"]["output_token_logprobs"]])
             for s in g] for g in groups]


def test_n_samples_per_prompt_in_order(group):
    sp = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "seed": 7}
    groups = group.generate(PROMPTS, sp, n=3)
    assert [len(g) for g in groups] == [3, 3, 3]
    for prompt, g in zip(PROMPTS, groups):
        for s in g:
            assert s["meta_info"]["prompt_tokens"] == len(prompt)
            assert len(s["output_ids"]) == len(s["meta_info"]["output_token_logprobs"]) == 5
    assert len({tuple(s["output_ids"]) for s in groups[1]}) > 1, "the samples are all equal"
    # Sample j of a prompt is the lone sample with seed 7 + j, on either replica.
    for j in range(3):
        lone = group.generate([PROMPTS[1]], dict(sp, seed=7 + j), n=1)[0][0]
        assert lone["output_ids"] == groups[1][j]["output_ids"]


def test_release_resume_keeps_greedy_outputs(group):
    group.flush_cache()
    before = _ids_and_logprobs(group.generate(PROMPTS, GREEDY))
    group.release_memory_occupation()
    info = group._all("get_server_info")
    assert all(i["memory_released"] for i in info), info
    group.resume_memory_occupation()
    after = _ids_and_logprobs(group.generate(PROMPTS, GREEDY))
    for gb, ga in zip(before, after):
        assert gb[0][0] == ga[0][0]
        np.testing.assert_allclose(gb[0][1], ga[0][1], atol=1e-6, rtol=0)


def test_pause_abort_then_continue(group):
    long = {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}
    pending = group.submit(PROMPTS[:2], long)  # one prompt per replica
    deadline = time.monotonic() + 60
    while not all(i["pool_stats"]["num_running"] > 0 for i in group._all("get_server_info")):
        assert time.monotonic() < deadline, "the rollout never ran on both replicas"
        time.sleep(0.05)
    group.pause_generation("abort")
    outs = pending.result(timeout_s=60)
    for g in outs:
        assert g[0]["meta_info"]["finish_reason"]["type"] == "abort", g[0]["meta_info"]
        assert len(g[0]["output_ids"]) < 100
    group.continue_generation()
    again = group.generate(PROMPTS[:2], GREEDY)
    assert all(len(g[0]["output_ids"]) == 6 for g in again)


def test_replica_errors_name_the_replica(group):
    from ray_app.rollout import RolloutError

    # Prompts 0 and 2 go to replica 0: text and token ids mixed there is an error in the actor.
    with pytest.raises(RolloutError, match=r"replica 0: ValueError: prompts: all strings"):
        group.generate(["some text", [1, 2, 3], [4, 5, 6]], GREEDY)

    bad = {"model.language_model.layers.0.nope.weight": np.zeros(4, np.float32)}
    with pytest.raises(RolloutError, match=r"replica 0: .*nope"):
        group.update_weights_from_tensor(bad, weight_version="bad")
    assert group.get_weight_version() == ["default", "default"]
