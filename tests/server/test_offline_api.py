"""The offline Engine answers as the server does, and the load / profiling routes.

Parity: an in-process ``Engine`` built from a server's own flags (float32) generates the
same requests the server gets over ``/generate`` (greedy and seeded sampling, logprobs, a
batch); text, tokens and every meta_info field match exactly but for the request ids and
latencies, and logprobs to 1e-4: which requests share a step depends on arrival timing on
both sides, and a ragged step's numerics differ in the last bits with its composition (in
bfloat16 by ~5e-3, enough to make a comparison of sampled tokens flaky). ``/get_load`` reports a running
request; ``/start_profile`` / ``/stop_profile`` write a jax trace and refuse misuse with 400.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import pytest
import requests

from tests.server.conftest import DEFAULT_FLAGS, start_server

VOLATILE = ("id", "e2e_latency")
FLAGS = ["--dtype", "float32"]
LOGPROB_TOL = 1e-4
pytestmark = pytest.mark.skipif(os.environ.get("STB_SERVER_TEST_ENGINE") == "fake",
                                reason="needs the real engine (the test double has no load or profiler)")


def _stable(out: dict) -> dict:
    return {**out, "meta_info": {k: v for k, v in out["meta_info"].items() if k not in VOLATILE}}


def assert_same(a, b, path="out"):
    """Equal structure and values; floats (logprobs) to LOGPROB_TOL."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, (path, a, b)
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= LOGPROB_TOL, (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.fixture(scope="module")
def f32_server():
    server = start_server(FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline():
    from sglang_tpu_backend import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with Engine(ServerArgs.from_cli_args(parser.parse_args(DEFAULT_FLAGS + FLAGS))) as eng:
        yield eng


# Each body's prompts are new to the server's prefix cache (and under one page long).
BODIES = [
    {"text": ["parity alpha one", "parity beta two three"], "return_logprob": True,
     "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    {"text": "parity gamma seeded", "return_logprob": True, "logprob_start_len": 0,
     "sampling_params": {"max_new_tokens": 6, "temperature": 0.9, "top_p": 0.9, "seed": 7}},
    {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                                        "n": 2, "seed": 3}},
]


@pytest.mark.parametrize("body", BODIES, ids=["greedy-batch", "seeded", "n2-ids"])
def test_offline_generate_matches_the_server(f32_server, offline, body):
    http = requests.post(f32_server.url + "/generate", json=body, timeout=300)
    assert http.status_code == 200, http.text
    kwargs = {k: v for k, v in body.items() if k not in ("text", "input_ids", "sampling_params")}
    local = offline.generate(body.get("text"), body["sampling_params"], body.get("input_ids"), **kwargs)
    remote = http.json()
    assert type(local) is type(remote)
    if isinstance(remote, dict):
        local, remote = [local], [remote]
    assert len(local) == len(remote)
    for a, b in zip(local, remote):
        assert_same(_stable(a), _stable(b))


def test_get_load_sees_a_running_request(live_server):
    live_server.wait_pools_empty()
    idle = requests.get(live_server.url + "/get_load", timeout=30).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    body = {"input_ids": list(range(5, 25)), "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    with requests.post(live_server.url + "/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream (a disconnect: abort)
        first = next(lines)  # the first chunk: the request runs
        deadline = time.monotonic() + 10
        while True:  # (it runs for seconds; poll in case a report raced its admission)
            load = requests.get(live_server.url + "/get_load", timeout=30).json()
            if load[0]["num_reqs"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert load[0]["num_reqs"] == 1 and load[0]["num_waiting_reqs"] == 0, (load, first)
    assert load[0]["num_tokens"] >= 32  # 20 prompt tokens + output, pages of 16
    assert load[0]["num_tokens"] % 16 == 0
    live_server.wait_pools_empty()


def _post(server, path, body=None):
    return requests.post(server.url + path, json=body, timeout=120)


def test_profile_routes(live_server, tmp_path):
    out = str(tmp_path / "trace")
    r = _post(live_server, "/start_profile", {"output_dir": out})
    assert r.status_code == 200, r.text
    again = _post(live_server, "/start_profile", {"output_dir": out})
    assert again.status_code == 400 and "already in progress" in again.json()["error"]["message"]
    assert requests.post(live_server.url + "/generate", timeout=120, json={
        "text": "profile me", "sampling_params": {"max_new_tokens": 3}}).status_code == 200
    assert _post(live_server, "/stop_profile").status_code == 200
    assert glob.glob(f"{out}/plugins/profile/*/*.xplane.pb")
    stop = _post(live_server, "/stop_profile")
    assert stop.status_code == 400 and "not in progress" in stop.json()["error"]["message"]
    bad = _post(live_server, "/start_profile", {"num_steps": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_steps"
    bad = _post(live_server, "/start_profile", {"output_dir": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "output_dir"


def test_profile_num_steps_stops_by_itself(live_server, tmp_path):
    out = str(tmp_path / "steps")
    assert _post(live_server, "/start_profile", {"output_dir": out, "num_steps": 2}).status_code == 200
    assert requests.post(live_server.url + "/generate", timeout=120, json={
        "text": "two steps", "sampling_params": {"max_new_tokens": 4}}).status_code == 200
    deadline = time.monotonic() + 30
    while not glob.glob(f"{out}/plugins/profile/*/*.xplane.pb") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert glob.glob(f"{out}/plugins/profile/*/*.xplane.pb")
    assert _post(live_server, "/stop_profile").status_code == 400  # already stopped


def test_profile_without_num_steps_stops_after_max_seconds(tmp_path):
    """A trace nobody stops ends by itself after ``max_seconds`` (--profile-max-seconds) and is
    written; a stop afterwards is a 400."""
    from sglang_tpu_backend.managers.io_struct import InvalidRequestError
    from sglang_tpu_backend.managers.profiler import StepProfiler

    prof = StepProfiler(max_seconds=0.3)
    out = str(tmp_path / "timed")
    prof.start(out, None, current_step=0)
    assert prof.running
    deadline = time.monotonic() + 30
    while not glob.glob(f"{out}/plugins/profile/*/*.xplane.pb") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert glob.glob(f"{out}/plugins/profile/*/*.xplane.pb")  # written by the timer's stop
    with pytest.raises(InvalidRequestError, match="not in progress"):
        prof.stop()
    assert not prof.running
