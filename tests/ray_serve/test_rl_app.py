"""SGLang's RL routes on the Ray Serve app (``ray_app/ingress.RemoteEngine``): every call
reaches every replica of every engine deployment through the broadcast.

Without a cluster, over in-process replicas (``test_health.FakeDeployment``) of a prefill
deployment of 2 replicas and a decode deployment of 1, whose engines are stubs: pause sums
the replicas' counts and a bad mode is every replica's 400; a release refused by one replica
is undone on the others and names it; a weight update reaches all three (one ``ray.put``
payload read by each), a bad name is refused by all with nothing changed, a replica failing
alone is named with the others said to serve the update; the calls that stop or change
replicas are refused up front, touching none, while a replica is starting or a running one is
not reachable; differing weight versions are a 503; the weights update group routes answer
501 naming why.

On a local Ray cluster (127.0.0.1, started and stopped here), the colocated app with 2 engine
replicas, over HTTP: pause -> a request queues -> continue -> it finishes with the greedy
tokens of before; release -> generate is a 503 naming the release -> resume -> the same greedy
tokens; an update from tensors (``lm_head`` rows reversed) changes the greedy output, both
replicas report its weight version (asked through the broadcast from here), and a bad tensor
name is a 400 naming it with the update's weights kept; an update from disk (the checkpoint
again) reaches both replicas and brings the first greedy tokens back. The disaggregated app (1
prefill + 1 decode replica): an in-place pause holds a request until continue; an update from
tensors reaches both replicas and gives the colocated app's greedy tokens under that update;
before it, ``return_routed_experts`` (both roles started with the flag) answers the colocated
in-process engine's tokens and routed-expert rows, and the colocated app (flag off) a 400
naming the field.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parents[2]
ENV = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
ARGS = dict(dtype="float32", page_size="16", max_running_requests="4", chunked_prefill_size="64",
            context_length="256", skip_warmup="true", random_seed="0", log_level="warning",
            engine_replicas="2", num_cpus="0.5")
# Disaggregated: one prefill and one decode replica (one CPU device each), both serving
# routed experts (``--enable-return-routed-experts``, unprefixed: both roles).
PD_ARGS = {**{k: v for k, v in ARGS.items() if k != "engine_replicas"}, "mode": "disaggregated",
           "enable_return_routed_experts": "true"}
# 70 tokens: two 64-token prefill chunks, five KV pages handed over.
ROUTED_PROMPT = [int(x) for x in np.random.default_rng(70).integers(3, 1000, size=70)]
PROMPT = [5, 17, 300, 42, 9, 8, 7]
BAD_NAME = "model.language_model.layers.0.nope.weight"


# Without a cluster -------------------------------------------------------------------------
class RLStub:
    """An engine's RL calls, recorded: ``busy`` refuses a release (requests run there),
    ``update_error`` makes a weight update fail on this replica alone."""

    def __init__(self, busy: bool = False, update_error: str | None = None):
        self.busy, self.update_error = busy, update_error
        self.paused, self.released, self.version = None, set(), "default"
        self.seen: list = []  # the tensors each update received

    def pause_generation(self, mode: str = "abort") -> dict:
        from sglang_tpu_backend.managers.io_struct import InvalidRequestError

        if mode not in ("abort", "retract", "in_place"):
            raise InvalidRequestError("mode", f"mode must be abort, retract or in_place, not {mode!r}")
        self.paused = mode
        return {"success": True, "mode": mode, "num_aborted": 2, "num_retracted": 0}

    def continue_generation(self) -> dict:
        self.paused = None
        return {"success": True}

    def release_memory_occupation(self, tags=None) -> dict:
        from sglang_tpu_backend.managers.rl_control import RLStateError

        if self.busy:
            raise RLStateError("tags", "cannot release memory while 1 request(s) are queued or running")
        self.released |= set(tags or ("kv_cache", "weights"))
        return {"success": True, "tags": sorted(self.released), "freed_bytes": 100}

    def resume_memory_occupation(self, tags=None) -> dict:
        self.released -= set(tags or ("kv_cache", "weights"))
        return {"success": True, "tags": sorted(self.released)}

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True,
                                   weight_version=None, abort_all_requests=False) -> dict:
        self.seen.append(named)
        if self.update_error:
            raise RuntimeError(self.update_error)
        bad = [n for n in named if "nope" in n]
        if bad:
            return {"success": False, "message": f"unknown tensor {bad[0]}", "num_paused_requests": 0}
        self.version = weight_version
        return {"success": True, "message": "Succeeded to update model weights",
                "num_paused_requests": 1}

    def get_weight_version(self) -> str:
        return self.version

    def shutdown(self) -> None:  # (EngineServer.__del__)
        pass


def _pd_remote(*stubs: RLStub, states: dict | None = None):
    """A RemoteEngine over prefill replicas p0, p1 and decode replica d0 running ``stubs``;
    ``states``: what Serve's status says of the replicas (default: all running)."""
    from ray_app.config import parse_app_args
    from ray_app.ingress import RemoteEngine
    from tests.ray_serve.test_health import FakeDeployment, replica

    prefill = FakeDeployment("PrefillServer", [replica(stubs[0], "p0", "prefill"),
                                               replica(stubs[1], "p1", "prefill")])
    decode = FakeDeployment("DecodeServer", [replica(stubs[2], "d0", "decode")])
    remote = RemoteEngine(parse_app_args({}).server_args, prefill=prefill, decode=decode)
    remote._replica_states = lambda: states or {"PrefillServer": {"RUNNING": 2},
                                                "DecodeServer": {"RUNNING": 1}}
    return remote


def test_rl_calls_reach_every_replica_and_name_failures():
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.managers.io_struct import InvalidRequestError, ServiceUnavailableError

    stubs = [RLStub(), RLStub(), RLStub()]
    remote = _pd_remote(*stubs)
    paused = asyncio.run(remote.pause_generation("retract"))
    assert paused == {"success": True, "mode": "retract", "num_aborted": 6, "num_retracted": 0}
    assert [s.paused for s in stubs] == ["retract"] * 3
    with pytest.raises(InvalidRequestError, match="refused by 3 of 3 replicas") as bad_mode:
        asyncio.run(remote.pause_generation("later"))
    assert bad_mode.value.field == "mode"
    assert asyncio.run(remote.continue_generation()) == {"success": True}
    assert [s.paused for s in stubs] == [None] * 3

    released = asyncio.run(remote.release_memory_occupation(["kv_cache"]))
    assert released == {"success": True, "tags": ["kv_cache"], "freed_bytes": 300}
    assert asyncio.run(remote.resume_memory_occupation(None)) == {"success": True, "tags": []}

    # A release refused by one replica is undone on the others.
    busy = [RLStub(), RLStub(busy=True), RLStub()]
    with pytest.raises(InvalidRequestError, match="refused by 1 of 3 replicas: PrefillServer "
                       "replica p1: tags: cannot release memory") as refused:
        asyncio.run(_pd_remote(*busy).release_memory_occupation())
    assert "the replicas that released resumed again" in refused.value.message
    assert [s.released for s in busy] == [set()] * 3

    # A weight update reaches every replica; a bad name is refused by all, nothing changed.
    named = {"lm_head.weight": np.ones((2, 2), np.float32)}
    ok = asyncio.run(remote.update_weights_from_tensor(named, weight_version="v1"))
    assert ok["success"] and ok["num_paused_requests"] == 3, ok
    assert "on all 3 engine replicas" in ok["message"]
    assert [s.version for s in stubs] == ["v1"] * 3
    assert all(s.seen[-1]["lm_head.weight"] is named["lm_head.weight"] for s in stubs)
    assert asyncio.run(remote.get_weight_version()) == "v1"
    bad = asyncio.run(remote.update_weights_from_tensor({BAD_NAME: np.zeros(2)}, weight_version="v2"))
    assert not bad["success"] and "failed on 3 of 3 replicas" in bad["message"], bad
    assert BAD_NAME in bad["message"] and "nothing was changed" in bad["message"]
    assert [s.version for s in stubs] == ["v1"] * 3

    # A replica failing alone is named; the others serve the update, the versions differ.
    lone = [RLStub(), RLStub(), RLStub(update_error="device lost")]
    mixed = _pd_remote(*lone)
    res = asyncio.run(mixed.update_weights_from_tensor(named, weight_version="v1"))
    assert not res["success"]
    assert "failed on 1 of 3 replicas: DecodeServer replica d0: RuntimeError: device lost" in res["message"]
    assert "2 replica(s) serve the new weights (PrefillServer replica p0, PrefillServer replica p1)" \
        in res["message"]
    with pytest.raises(ServiceUnavailableError, match="different weight versions: .*"
                                                      "DecodeServer replica d0: default"):
        asyncio.run(mixed.get_weight_version())

    # A replica starting, or a running one the broadcast does not reach: refused up front.
    for states, why in [({"PrefillServer": {"RUNNING": 2, "STARTING": 1}, "DecodeServer": {"RUNNING": 1}},
                         "replicas are not all running ({'PrefillServer': {'STARTING': 1}})"),
                        ({"PrefillServer": {"RUNNING": 3}, "DecodeServer": {"RUNNING": 1}},
                         "PrefillServer: 2 of its 3 running replicas are reachable")]:
        fresh = [RLStub(), RLStub(), RLStub()]
        blocked = _pd_remote(*fresh, states=states)
        res = asyncio.run(blocked.update_weights_from_tensor(named, weight_version="v9"))
        assert not res["success"] and why in res["message"] and "nothing was changed" in res["message"]
        for call in (blocked.pause_generation, blocked.release_memory_occupation):
            with pytest.raises(ServiceUnavailableError, match="every engine replica reachable"):
                asyncio.run(call())
        assert all(s.version == "default" and s.paused is None and not s.released and not s.seen
                   for s in fresh)

    client = TestClient(create_app(remote))
    for route in ("init_weights_update_group", "update_weights_from_distributed",
                  "destroy_weights_update_group"):
        r = client.post(f"/{route}", json={})
        assert r.status_code == 501, r.text
        assert "RolloutGroup" in r.json()["error"]["message"]


# On a Ray cluster --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    from ray_app import app

    temp_dir = tempfile.mkdtemp(prefix="ray_rl_", dir="/tmp")
    os.environ.update(ENV)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, runtime_env={"env_vars": ENV})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(dict(ARGS)), name="rl", route_prefix="/rl", blocking=False)
        serve.run(app(PD_ARGS), name="rlpd", route_prefix="/rlpd")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _generate(url: str) -> requests.Response:
    return requests.post(f"{url}/generate", timeout=300, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}})


def _greedy(url: str) -> list[int]:
    r = _generate(url)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _post(url: str, route: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/{route}", json=body or {}, timeout=300)


def _replica_versions(app: str = "rl", deployment: str = "EngineServer") -> dict[str, str]:
    """Each replica's weight version, asked through the broadcast from here."""
    handle = serve.get_deployment_handle(deployment, app)
    answers = handle.broadcast("on_replica", "get_weight_version").results(timeout_s=60)
    return {a["replica"]: a["result"] for a in answers}


def _reversed_lm_head() -> dict:
    from sglang_tpu_backend.entrypoints.rl_routes import encode_named_tensors
    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    lm_head = read_checkpoint(default_model_path())["lm_head.weight"]
    return {"serialized_named_tensors": encode_named_tensors({"lm_head.weight": lm_head[::-1]}),
            "weight_version": "rl-1"}


def test_rl_routes_over_two_replicas(base_url):
    from sglang_tpu_backend.entrypoints.rl_routes import encode_named_tensors
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    url = base_url + "/rl"
    before = _greedy(url)
    assert _greedy(url) == before  # whichever replica serves it

    # Pause: a request queues until continue_generation, then runs as before.
    r = _post(url, "pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json()["success"], r.text
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_generate(url)))
    t.start()
    time.sleep(1.5)
    assert t.is_alive(), "a request ran while generation was paused"
    r = _post(url, "continue_generation")
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    t.join(120)
    assert result["r"].status_code == 200 and result["r"].json()["output_ids"] == before

    # Release: generate is refused (503) until resume; then the same greedy tokens.
    r = _post(url, "release_memory_occupation")
    assert r.status_code == 200, r.text
    assert r.json()["tags"] == ["kv_cache", "weights"] and r.json()["freed_bytes"] > 0
    refused = _generate(url)
    assert refused.status_code == 503, refused.text
    assert "memory is released" in refused.json()["error"]["message"]
    r = _post(url, "resume_memory_occupation")
    assert r.status_code == 200 and r.json() == {"success": True, "tags": []}, r.text
    assert _greedy(url) == before

    # Weights from tensors: lm_head's rows reversed, on both replicas.
    r = _post(url, "update_weights_from_tensor", _reversed_lm_head())
    assert r.status_code == 200 and r.json()["success"], r.text
    assert "on all 2 engine replicas" in r.json()["message"]
    after = _greedy(url)
    assert after != before
    versions = _replica_versions()
    assert len(versions) == 2 and set(versions.values()) == {"rl-1"}, versions
    assert requests.get(f"{url}/get_weight_version", timeout=60).json() == {"weight_version": "rl-1"}

    # A bad name: 400 naming it, the update's weights kept on both replicas.
    r = _post(url, "update_weights_from_tensor", {
        "serialized_named_tensors": encode_named_tensors({BAD_NAME: np.zeros(4, np.float32)}),
        "weight_version": "rl-2"})
    assert r.status_code == 400 and not r.json()["success"], r.text
    assert "layers.0.nope.weight" in r.json()["message"] and "nothing was changed" in r.json()["message"]
    assert set(_replica_versions().values()) == {"rl-1"}
    assert _greedy(url) == after

    # From disk, on both replicas too: the checkpoint's weights serve again.
    r = _post(url, "update_weights_from_disk", {"model_path": str(default_model_path()),
                                                "weight_version": "disk-1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert set(_replica_versions().values()) == {"disk-1"}
    assert _greedy(url) == before


def _colocated_routed(ids: list[int]) -> tuple[dict, tuple[int, int]]:
    """The final output for ``ids`` (greedy, 8 tokens, ``return_routed_experts``) of an
    in-process colocated engine of the /rlpd app's engine arguments, and the model's (MoE
    layers, top_k)."""
    from ray_app.config import parse_app_args
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.model_executor.routed_experts import num_moe_layers

    eng = Engine(parse_app_args({**PD_ARGS, "mode": "colocated"}).server_args)
    try:
        obj = GenerateReqInput(input_ids=ids, return_routed_experts=True, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})

        async def final():
            return [o async for o in eng.generate_request(obj)][-1]

        cfg = eng.model_config
        return asyncio.run(final()), (num_moe_layers(cfg), cfg.num_experts_per_tok)
    finally:
        eng.shutdown()


def test_routed_experts_over_http_through_prefill_and_decode(base_url):
    """``return_routed_experts`` on the disaggregated app (runs before the weight updates of
    ``test_rl_routes_reach_prefill_and_decode``: the checkpoint's weights): the prompt's rows
    come from the prefill replica through the handover, the output's from the decode replica;
    ``meta_info["routed_experts"]`` decodes to i32[prompt + output - 1, MoE layers, top_k] and
    equals a colocated in-process engine's, output tokens too. The colocated /rl app (flag
    off) answers 400 naming the field; the flag on one role only is refused when the app is
    built."""
    from ray_app import app
    from sglang_tpu_backend.model_executor.routed_experts import decode

    body = {"input_ids": ROUTED_PROMPT, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = _post(base_url + "/rlpd", "generate", body)
    assert r.status_code == 200, r.text
    got, (want, (layers, top_k)) = r.json(), _colocated_routed(ROUTED_PROMPT)
    assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == 8
    rows = decode(got["meta_info"]["routed_experts"], layers, top_k)
    assert rows.shape == (len(ROUTED_PROMPT) + 8 - 1, layers, top_k)
    np.testing.assert_array_equal(rows, decode(want["meta_info"]["routed_experts"], layers, top_k))

    refused = _post(base_url + "/rl", "generate", body)
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "return_routed_experts" and "--enable-return-routed-experts" in err["message"]
    for role in ("prefill", "decode"):
        one_role = {**{k: v for k, v in PD_ARGS.items() if k != "enable_return_routed_experts"},
                    f"{role}_enable_return_routed_experts": "true"}
        with pytest.raises(ValueError, match=f"enable_return_routed_experts is on for the {role} "
                                             "replicas only"):
            app(one_role)


def test_rl_routes_reach_prefill_and_decode(base_url):
    """Disaggregated: pause / continue and an update from tensors reach the prefill and the
    decode replica; the updated app's greedy tokens are the colocated app's under the same
    update (``test_rl_routes_over_two_replicas`` computes them: the update again there)."""
    url = base_url + "/rlpd"
    before = _greedy(url)
    r = _post(url, "pause_generation", {"mode": "in_place"})
    assert r.status_code == 200 and r.json()["mode"] == "in_place", r.text
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_generate(url)))
    t.start()
    time.sleep(1.5)
    assert t.is_alive(), "a request ran while generation was paused"
    assert _post(url, "continue_generation").status_code == 200
    t.join(120)
    assert result["r"].status_code == 200 and result["r"].json()["output_ids"] == before

    r = _post(url, "update_weights_from_tensor", _reversed_lm_head())
    assert r.status_code == 200 and r.json()["success"], r.text
    assert "on all 2 engine replicas" in r.json()["message"]
    assert _replica_versions("rlpd", "PrefillServer").popitem()[1] == "rl-1"
    assert _replica_versions("rlpd", "DecodeServer").popitem()[1] == "rl-1"
    after = _greedy(url)
    assert after != before
    colo = base_url + "/rl"
    assert _post(colo, "update_weights_from_tensor", _reversed_lm_head()).status_code == 200
    assert _greedy(colo) == after
