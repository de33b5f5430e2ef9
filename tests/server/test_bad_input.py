"""Every client mistake gets the right 4xx with a JSON error naming the field, and leaves the
server healthy with the engine's pools back to empty (pool stats from /get_server_info)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
import requests

from tests.server.conftest import start_server

CONTEXT = 2048  # conftest.DEFAULT_FLAGS --context-length
BODY_LIMIT = 65536  # conftest.DEFAULT_FLAGS --max-request-body-bytes


@pytest.fixture(autouse=True)
def healthy_and_empty_after(live_server):
    yield
    assert requests.get(live_server.url + "/health", timeout=30).status_code == 200
    stats = live_server.wait_pools_empty()
    assert stats["kv_pages_used"] == 0, stats
    assert stats["state_slots_used"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_queued"] == 0, stats


def check_error(r, status: int, param_part: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert param_part in (err["param"] or ""), err
    return err


def post(server, path, **kw):
    return requests.post(server.url + path, timeout=120, **kw)


def test_malformed_json(live_server):
    check_error(post(live_server, "/generate", data=b'{"text": "a",', headers={"Content-Type": "application/json"}),
                400, "body")
    check_error(post(live_server, "/v1/chat/completions", data=b"not json"), 400, "body")
    check_error(post(live_server, "/generate", json=["a list"]), 400, "body")


@pytest.mark.parametrize("body,param", [
    ({"text": "a", "input_ids": [1, 2]}, "input_ids"),
    ({"sampling_params": {"max_new_tokens": 1}}, "text"),
    ({"text": 12}, "text"),
    ({"text": ["a", 3]}, "text"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "sampling_params": [1]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "sampling_params": {"n": -2}}, "sampling_params.n"),
])
def test_wrong_shapes_and_types(live_server, body, param):
    check_error(post(live_server, "/generate", json=body), 400, param)


def test_token_ids_outside_vocabulary(live_server):
    check_error(post(live_server, "/generate", json={"input_ids": [1, 2, 10**7]}), 400, "input_ids")
    check_error(post(live_server, "/generate", json={"input_ids": [1, -1]}), 400, "input_ids")


def test_prompt_longer_than_context(live_server):
    check_error(post(live_server, "/generate", json={"input_ids": [5] * (CONTEXT + 10)}), 400, "input_ids")
    check_error(post(live_server, "/generate", json={"text": "hello " * (CONTEXT + 10)}), 400, "")


@pytest.mark.parametrize("sp,param", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": CONTEXT * 4}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": json.dumps({"type": "no-such-type"})}, "json_schema"),
])
def test_bad_sampling_params(live_server, sp, param):
    check_error(post(live_server, "/generate", json={"text": "hi", "sampling_params": sp}), 400, param)


def test_bad_openai_params(live_server):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    check_error(post(live_server, "/v1/chat/completions", json={**base, "top_p": 2}), 400, "top_p")
    check_error(post(live_server, "/v1/chat/completions", json={**base, "max_tokens": -3}), 400, "max_tokens")
    check_error(post(live_server, "/v1/completions", json={"model": "m", "prompt": [1, 10**7]}), 400, "")


def test_bad_item_in_batch_frees_the_good_ones(live_server):
    body = {"text": ["fine", "also fine"], "sampling_params": [{"max_new_tokens": 4}, {"temperature": -1}]}
    check_error(post(live_server, "/generate", json=body), 400, "temperature")


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "a", "sampling_params": {"n": 100000}}, "sampling_params.n"),
    ("/generate", {"text": "a", "sampling_params": {"n": 129}}, "sampling_params.n"),
    ("/generate", {"text": ["a"] * 1025}, "text"),
    ("/generate", {"input_ids": [[5, 6]] * 1025}, "input_ids"),
    ("/generate", {"text": ["a"] * 10, "sampling_params": {"n": 128}}, "sampling_params.n"),  # 1280 samples
    ("/v1/completions", {"model": "m", "prompt": "a", "n": 129}, "n"),
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 1025}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 100000}, "n"),
])
def test_fanout_limits(live_server, path, body, param):
    check_error(post(live_server, path, json=body), 400, param)


def test_deeply_nested_json_is_400(live_server):
    deep = b"[" * 5000 + b"]" * 5000
    err = check_error(post(live_server, "/generate", data=deep, headers={"Content-Type": "application/json"}),
                      400, "body")
    assert "nested" in err["message"]
    nested = b'{"text": "hi", "sampling_params": {"stop": ' + b"[" * 100 + b'"x"' + b"]" * 100 + b"}}"
    check_error(post(live_server, "/v1/completions", data=nested, headers={"Content-Type": "application/json"}),
                400, "body")


def test_unknown_route_and_wrong_method(live_server):
    check_error(requests.get(live_server.url + "/no/such/route", timeout=30), 404, "path")
    check_error(post(live_server, "/v1/nothing", json={}), 404, "path")
    check_error(requests.get(live_server.url + "/generate", timeout=30), 405, "method")


def test_oversized_body_413(live_server):
    big = json.dumps({"text": "x" * (BODY_LIMIT + 100)}).encode()
    check_error(post(live_server, "/generate", data=big, headers={"Content-Type": "application/json"}),
                413, "body")

    def chunks():  # chunked transfer: no Content-Length, caught while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    check_error(post(live_server, "/generate", data=chunks(), headers={"Content-Type": "application/json"}),
                413, "body")


def test_client_disconnect_mid_stream_frees_pages_and_slot(live_server):
    body = json.dumps({"text": "disconnect me", "stream": True,
                       "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}})
    conn = http.client.HTTPConnection("127.0.0.1", live_server.port, timeout=120)
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200
        first = resp.readline()  # de-chunked
        assert first.startswith(b"data: "), first
        running = live_server.pool_stats()
        assert running["num_running"] == 1 and running["kv_pages_used"] > 0, running
        assert running["state_slots_used"] == 1, running
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    t0 = time.monotonic()
    stats = live_server.wait_pools_empty(timeout=30)
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0, stats
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def keyed_server():
    server = start_server(["--api-key", "sk-test-123"])
    server.headers = lambda: {"Authorization": "Bearer sk-test-123"}
    yield server
    server.stop()


def test_api_key(keyed_server):
    url = keyed_server.url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    check_error(requests.post(url + "/generate", json=body, timeout=60), 401, "authorization")
    check_error(requests.post(url + "/generate", json=body, timeout=60,
                              headers={"Authorization": "Bearer wrong"}), 401, "authorization")
    check_error(requests.get(url + "/v1/models", timeout=60), 401, "authorization")
    check_error(requests.get(url + "/get_model_info", timeout=60, headers={"Authorization": "sk-test-123"}),
                401, "authorization")
    assert requests.get(url + "/health", timeout=60).status_code == 200
    assert requests.get(url + "/health_generate", timeout=120).status_code == 200
    ok = requests.post(url + "/generate", json=body, timeout=120, headers=keyed_server.headers())
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) <= 2
    assert keyed_server.wait_pools_empty()["kv_pages_used"] == 0
