"""Multi-host engine replicas on a local Ray cluster (127.0.0.1, started and stopped here).

App ``mh``: one colocated engine replica spans 2 "hosts" (``hosts_per_replica=2``, placement
strategy PACK on this one-node cluster): the replica leads (node 0) and a follower actor in the
replica's placement group follows, each process with 4 CPU devices (``cpu_devices_per_host``),
one 8-device DP x EP mesh, prefix cache on. App ``mhpd``: a DP2 prefill replica hands over to
a DP4 decode replica over 2 processes x 2 devices, through the device-to-device transport
(``jax.experimental.transfer``). Asserts: ``/generate`` gives the same
greedy outputs as an in-process one-device engine with the same settings (DP and one device
agree, see tests/engine/test_dp_engine.py) for a short prompt and one longer than a prefill
chunk, a repeat reuses its cached prefix; through PD, 18 concurrent requests decode on ranks
of both processes with the one-device tokens and logprobs (1e-5) and leave every rank free;
the follower is in bundle 1 of the replica's placement group; killing the follower actor
makes the replica unhealthy and a request sent then ends (abort message or an error status),
never hangs. Every wait has a deadline; Serve and Ray are shut down in a ``finally``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
# The colocated app: one replica over 2 processes x 4 devices, prefix cache on.
ARGS = dict(ENGINE, dp_size="8", ep_size="8", hosts_per_replica="2", placement_strategy="PACK",
            cpu_devices_per_host="4", health_check_period_s="1", health_check_timeout_s="30",
            disable_radix_cache="false")
# The disaggregated app: a DP2 prefill replica hands over to a DP4 decode replica spanning
# 2 processes x 2 devices (ranks 2, 3 on the follower: their state crosses processes), the
# state pulled by the decode replica's transfer server from the prefill replica's.
PD_ARGS = dict(ENGINE, mode="disaggregated", prefill_dp_size="2", prefill_ep_size="2",
               prefill_cpu_devices_per_host="2", decode_dp_size="4", decode_ep_size="4",
               decode_hosts_per_replica="2", decode_placement_strategy="PACK",
               decode_cpu_devices_per_host="2", max_running_requests="8", transport="device")
PROMPT_LENS = (5, 45)  # 45 > chunked_prefill_size: two prefill chunks
PD_LENS = (5, 17, 45, 64, 90, 121)  # up to 4 prefill chunks and 8 pages, GDN chunks of 64
MAX_NEW = 6
DEPLOY_DEADLINE_S = 300


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(3, 1000, size=n)]


def _body(ids: list[int], logprobs: bool = False) -> dict:
    return {"input_ids": ids, "return_logprob": logprobs,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


def _logprobs(out: dict) -> np.ndarray:
    return np.array([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def _status(app: str = "mh"):
    return serve.status().applications[app]


@pytest.fixture(scope="module")
def base_url():
    from ray_app import app

    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    os.environ.update(env)
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, args in (("mh", ARGS), ("mhpd", PD_ARGS)):
            serve._run(app(dict(args)), name=name, route_prefix=f"/{name}", _blocking=False)
        deadline = time.monotonic() + DEPLOY_DEADLINE_S
        for name in ("mh", "mhpd"):
            while (st := _status(name).status) != "RUNNING":
                assert st != "DEPLOY_FAILED", _status(name)
                assert time.monotonic() < deadline, (
                    f"{name} not running after {DEPLOY_DEADLINE_S}s: {_status(name)}")
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
        obj = GenerateReqInput(**_body(ids, logprobs=True))
        return [o async for o in eng.generate_request(obj)][-1]

    try:
        outs = {n: asyncio.run(run(_prompt(n))) for n in sorted({*PROMPT_LENS, *PD_LENS})}
        yield {n: o["output_ids"] for n, o in outs.items()} | {
            ("logprobs", n): _logprobs(o) for n, o in outs.items()}
    finally:
        eng.shutdown()


def _followers(app: str = "mh", deployment: str = "EngineServer") -> list[dict]:
    """Named follower actors of the app's replica: [{"name", "namespace"}]."""
    info = serve.get_deployment_handle(deployment, app_name=app).multihost_info.remote(
        ).result(timeout_s=60)
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"] in info["followers"]]


def test_multihost_replica_serves_greedy_outputs_of_one_engine(base_url, standalone):
    info = requests.get(f"{base_url}/get_server_info", timeout=60).json()
    assert info["nnodes"] == 2 and info["dp_size"] == 8, info
    for n in PROMPT_LENS:
        r = requests.post(f"{base_url}/generate", json=_body(_prompt(n)), timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == standalone[n], (n, out["output_ids"], standalone[n])
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_prefix_cache_hits_on_a_multihost_replica(base_url, standalone):
    """The leader owns the prefix tree, the follower repeats its snapshot copies: a repeated
    prompt reuses its cached chunk and decodes what one device decodes."""
    n = PROMPT_LENS[-1]
    r = requests.post(f"{base_url}/generate", json=_body(_prompt(n)), timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["cached_tokens"] >= 32, r.json()["meta_info"]
    assert r.json()["output_ids"] == standalone[n]


def test_prefill_hands_over_to_a_two_process_decode_replica(base_url, standalone):
    """DP2 prefill -> DP4 decode over 2 processes, 18 concurrent float32 requests of 5 to
    121 tokens: each request is decoded on the least-loaded decode rank (ranks 2 and 3 sit on the follower's devices), so concurrent
    requests land on both processes; the greedy tokens are those of one device (logprobs
    within 1e-5), and every
    rank's pages and slots are free afterwards."""
    url = base_url.replace("/mh", "/mhpd")
    prompts = [_prompt(n) for n in PD_LENS] * 3  # 18 concurrent: every decode rank used
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: requests.post(
            f"{url}/generate", json=_body(ids, logprobs=True), timeout=300), prompts))
    for ids, r in zip(prompts, outs):
        assert r.status_code == 200, r.text
        n = len(ids)
        assert r.json()["output_ids"] == standalone[n], (n, r.json())
        np.testing.assert_allclose(_logprobs(r.json()), standalone["logprobs", n], atol=1e-5)
    info = requests.get(f"{url}/get_server_info", timeout=60).json()  # the decode replica's
    ranks = info["dp_ranks"]
    assert info["nnodes"] == 2 and len(ranks) == 4, info
    admitted = [r["num_admitted_total"] for r in ranks]
    assert sum(admitted[:2]) > 0 and sum(admitted[2:]) > 0, admitted  # both processes decoded
    assert all(r["kv_pages_used"] == 0 and r["state_slots_used"] == 0 for r in ranks), ranks
    assert len(_followers("mhpd", "DecodeServer")) == 1


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
