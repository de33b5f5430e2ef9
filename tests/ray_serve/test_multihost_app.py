"""A multi-host engine replica on a local Ray cluster (127.0.0.1, started and stopped here).

The app's one engine replica spans 2 "hosts" (``hosts_per_replica=2``, placement strategy
PACK on this one-node cluster): the replica leads (node 0) and a follower actor in the
replica's placement group follows, each process with 4 CPU devices (``cpu_devices_per_host``),
one 8-device DP x EP mesh. Asserts: ``/generate`` gives the same greedy outputs as an
in-process one-device engine with the same settings (DP and one device agree, see
tests/engine/test_dp_engine.py) for a short prompt and one longer than a prefill chunk;
the follower is in bundle 1 of the replica's placement group; killing the follower actor
makes the replica unhealthy and a request sent then ends (abort message or an error status),
never hangs. Every wait has a deadline; Serve and Ray are shut down in a ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(dtype="float32", page_size="16", max_running_requests="16",
              chunked_prefill_size="32", context_length="128", skip_warmup="true",
              random_seed="0", log_level="warning", disable_radix_cache="true",
              compilation_cache_dir="")
ARGS = dict(ENGINE, dp_size="8", ep_size="8", hosts_per_replica="2", placement_strategy="PACK",
            cpu_devices_per_host="4", health_check_period_s="1", health_check_timeout_s="30")
PROMPT_LENS = (5, 45)  # 45 > chunked_prefill_size: two prefill chunks
MAX_NEW = 6
DEPLOY_DEADLINE_S = 300


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(3, 1000, size=n)]


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                  "ignore_eos": True}}


def _status():
    return serve.status().applications["mh"]


@pytest.fixture(scope="module")
def base_url():
    from ray_app import app

    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    os.environ.update(env)
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve._run(app(dict(ARGS)), name="mh", route_prefix="/mh", _blocking=False)
        deadline = time.monotonic() + DEPLOY_DEADLINE_S
        while (st := _status().status) != "RUNNING":
            assert st != "DEPLOY_FAILED", _status()
            assert time.monotonic() < deadline, f"not running after {DEPLOY_DEADLINE_S}s: {_status()}"
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/mh"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def standalone():
    """Greedy outputs of an in-process one-device engine with the same settings."""
    from ray_app.config import parse_app_args
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    eng = Engine(parse_app_args(ENGINE).server_args)

    async def run(ids):
        obj = GenerateReqInput(**_body(ids))
        return [o async for o in eng.generate_request(obj)][-1]["output_ids"]

    try:
        yield {n: asyncio.run(run(_prompt(n))) for n in PROMPT_LENS}
    finally:
        eng.shutdown()


def _followers() -> list[dict]:
    """Named follower actors: [{"name", "namespace"}]."""
    from ray_app.multihost import FOLLOWER_PREFIX

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(FOLLOWER_PREFIX)]


def test_multihost_replica_serves_greedy_outputs_of_one_engine(base_url, standalone):
    info = requests.get(f"{base_url}/get_server_info", timeout=60).json()
    assert info["nnodes"] == 2 and info["dp_size"] == 8, info
    for n in PROMPT_LENS:
        r = requests.post(f"{base_url}/generate", json=_body(_prompt(n)), timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == standalone[n], (n, out["output_ids"], standalone[n])
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_follower_sits_in_the_replicas_placement_group(base_url):
    info = serve.get_deployment_handle("EngineServer", app_name="mh").multihost_info.remote(
        ).result(timeout_s=60)
    followers = _followers()
    assert [a["name"] for a in followers] == info["followers"] and len(followers) == 1, info
    actor = ray.get_actor(followers[0]["name"], namespace=followers[0]["namespace"])
    pg = info["placement_group_id"]
    assert pg and ray.get(actor.placement_group_id.remote(), timeout=60) == pg
    table = ray.util.placement_group_table()[pg]
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2, table
    assert all(b.get("CPU") == 1 for b in table["bundles"].values()), table


def test_killing_the_follower_fails_the_replica_never_hangs(base_url):
    followers = _followers()
    assert len(followers) == 1, followers
    ray.kill(ray.get_actor(followers[0]["name"], namespace=followers[0]["namespace"]))
    t0 = time.monotonic()
    try:
        r = requests.post(f"{base_url}/generate", json=_body(_prompt(5)), timeout=180)
    except requests.ConnectionError as e:  # the proxy may drop the connection of a dead replica
        r = e
    took = time.monotonic() - t0
    if not isinstance(r, Exception) and r.status_code == 200:  # (what is seen: gloo's error)
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.json()
    elif not isinstance(r, Exception):
        assert r.status_code >= 500, r.text
    assert took < 180
    outcome = r if isinstance(r, Exception) else (r.status_code, r.text[:300])
    print(f"request after the follower died: {took:.1f}s, {outcome}")
    seen, deadline = set(), time.monotonic() + 120
    while time.monotonic() < deadline and not seen - {"HEALTHY"}:
        seen.add(_status().deployments["EngineServer"].status)
        time.sleep(0.5)
    assert seen - {"HEALTHY"}, f"the replica stayed healthy after its follower died: {seen}"
    print(f"deployment status after the kill: {seen} within {time.monotonic() - t0:.1f}s")
