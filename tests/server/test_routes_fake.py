"""Route-level unit tests: the real HTTP layer in-process over a FAKE engine (test double).

Fast checks of parsing, fan-out order, stream framing, error bodies, auth, body limits and
abort-on-disconnect, independent of the model. The live-server tests use the real engine.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sglang_tpu_backend.entrypoints.http_server import create_app
from sglang_tpu_backend.server_args import ServerArgs
from tests.server.fake_engine import FakeEngine


def _client(engine: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://t")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(ServerArgs(context_length=256, max_request_body_bytes=4096, random_seed=7))


async def _post(engine, path, body=None, content=None, headers=None):
    async with _client(engine) as c:
        return await c.post(path, json=body, content=content, headers=headers)


def _error(r, status, param_part):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert param_part in (err["param"] or ""), err
    return err


def _sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [blk for blk in text.split("\n\n") if blk]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


# /generate -------------------------------------------------------------------------------
def test_generate_single(engine):
    r = run(_post(engine, "/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 5},
                                        "rid": "r-single"}))
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["id"] == "r-single"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("hello world"))
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_batch_and_n_order_and_seeds(engine):
    engine.requests_seen.clear()
    body = {"input_ids": [[5, 6, 7], [8, 9, 10, 11, 12]], "sampling_params": {"max_new_tokens": 4, "n": 3}}
    r = run(_post(engine, "/generate", body))
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 3, 5, 5, 5]
    seeds = [q.sampling_params["seed"] for q in engine.requests_seen]
    assert len(set(seeds)) == 6 or len(set(seeds[:3])) == 3  # distinct within each prompt's samples
    by_prompt = {}
    for q in engine.requests_seen:
        by_prompt.setdefault(tuple(q.input_ids), []).append(q.sampling_params["seed"])
    for s in by_prompt.values():
        assert sorted(s) == list(range(min(s), min(s) + 3))
    assert all("n" not in q.sampling_params for q in engine.requests_seen)
    # distinct seeds give distinct samples (the fake samples from the seed)
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) == 3


def test_generate_n_with_seed_is_reproducible(engine):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 6, "n": 2, "sampling_seed": 100}}
    a, b = run(_post(engine, "/generate", body)).json(), run(_post(engine, "/generate", body)).json()
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert a[0]["output_ids"] != a[1]["output_ids"]


def test_generate_list_text_is_list_even_for_one(engine):
    r = run(_post(engine, "/generate", {"text": ["only"], "sampling_params": {"max_new_tokens": 1}}))
    assert isinstance(r.json(), list) and len(r.json()) == 1


def test_generate_stream_format_and_incremental_logprobs(engine):
    body = {"text": "stream me", "stream": True, "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 6}}
    r = run(_post(engine, "/generate", body))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse_events(r.text)
    assert len(chunks) >= 6
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    total = 0
    for c in chunks:
        m = c["meta_info"]
        assert m["output_token_logprobs_length"] == m["completion_tokens"]
        assert len(m["output_token_logprobs"]) == m["completion_tokens"] - total
        assert all(len(t) == 2 for t in m["output_top_logprobs"])
        total = m["completion_tokens"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert total == 6


def test_generate_batch_stream_has_index(engine):
    body = {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    chunks = _sse_events(run(_post(engine, "/generate", body)).text)
    assert {c["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["meta_info"].get("finish_reason")]
    assert sorted(c["index"] for c in finals) == [0, 1]


# Errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,param", [
    ({"sampling_params": {}}, 400, "text"),
    ({"text": "a", "input_ids": [1]}, 400, "input_ids"),
    ({"text": 5}, 400, "text"),
    ({"input_ids": "abc"}, 400, "input_ids"),
    ({"input_ids": [1, True]}, 400, "input_ids"),
    ({"text": "a", "sampling_params": "x"}, 400, "sampling_params"),
    ({"text": "a", "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ({"text": "a", "stream": "yes"}, 400, "stream"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ({"input_ids": [1, 10**6]}, 400, "input_ids"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
])
def test_generate_bad_input(engine, body, status, param):
    _error(run(_post(engine, "/generate", body)), status, param)
    assert engine.pool_stats()["kv_pages_used"] == 0


def test_malformed_json_and_non_object(engine):
    _error(run(_post(engine, "/generate", content=b"{not json")), 400, "body")
    _error(run(_post(engine, "/generate", content=b"[1, 2]")), 400, "body")
    _error(run(_post(engine, "/v1/completions", content=b"")), 400, "body")


def test_unknown_route_and_method(engine):
    async def go():
        async with _client(engine) as c:
            return await c.get("/nope"), await c.get("/generate")

    r404, r405 = run(go())
    _error(r404, 404, "path")
    _error(r405, 405, "method")


def test_body_limit_413(engine):
    big = json.dumps({"text": "x" * 5000}).encode()
    _error(run(_post(engine, "/generate", content=big)), 413, "body")

    async def chunked():  # no Content-Length: the limit is enforced while reading
        async def gen():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        async with _client(engine) as c:
            return await c.post("/generate", content=gen())

    _error(run(chunked()), 413, "body")


def test_api_key():
    eng = FakeEngine(ServerArgs(context_length=256, api_key="sekret"))
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}

    async def go():
        async with _client(eng) as c:
            return (await c.post("/generate", json=body),
                    await c.post("/generate", json=body, headers={"Authorization": "Bearer wrong"}),
                    await c.post("/generate", json=body, headers={"Authorization": "Bearer sekret"}),
                    await c.get("/health"), await c.get("/get_model_info"))

    missing, wrong, ok, health, info = run(go())
    _error(missing, 401, "authorization")
    _error(wrong, 401, "authorization")
    assert ok.status_code == 200 and health.status_code == 200
    _error(info, 401, "authorization")


# OpenAI ----------------------------------------------------------------------------------
def test_chat_usage_and_template(engine):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = run(_post(engine, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 3}))
    assert r.status_code == 200, r.text
    out = r.json()
    templated = engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    n_prompt = len(engine.tokenizer.encode(templated, add_special_tokens=False))
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["choices"][0]["finish_reason"] == "length"
    assert engine.requests_seen[-1].input_ids == engine.tokenizer.encode(templated, add_special_tokens=False)


def test_completion_n_logprobs_echo(engine):
    body = {"model": "m", "prompt": ["one", "two three"], "max_tokens": 4, "n": 2, "logprobs": 2, "echo": True}
    out = run(_post(engine, "/v1/completions", body)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"].startswith("one") and out["choices"][2]["text"].startswith("two three")
    lp = out["choices"][1]["logprobs"]
    p1, p2 = len(engine.tokenizer.encode("one")), len(engine.tokenizer.encode("two three"))
    # echo: the prompt's tokens come first, the first without a logprob
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == p1 + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert out["usage"]["prompt_tokens"] == p1 + p2
    assert out["usage"]["completion_tokens"] == 16


def test_chat_stream_chunks_and_usage(engine):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = _sse_events(run(_post(engine, "/v1/chat/completions", body)).text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert 0 < len(ids) <= 5 * 4


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -2},
     "temperature"),
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
])
def test_openai_bad_input(engine, path, body, param):
    _error(run(_post(engine, path, body)), 400, param)


# Disconnect --------------------------------------------------------------------------------
def test_stream_disconnect_aborts_engine_request():
    eng = FakeEngine(ServerArgs(context_length=4096), step_delay=0.01)
    app = create_app(eng)
    body = json.dumps({"text": "go", "stream": True, "rid": "dc", "sampling_params": {"max_new_tokens": 3000}}).encode()

    async def go():
        got_body = asyncio.Event()
        sent = []
        state = {"body_sent": False}

        async def receive():
            if not state["body_sent"]:
                state["body_sent"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await got_body.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and msg.get("body"):
                assert eng.held  # the request is running while it streams
                got_body.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/generate", "raw_path": b"/generate",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                     (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
        for _ in range(100):  # the generators unwind in their own tasks
            if not eng.held:
                break
            await asyncio.sleep(0.01)
        return sent

    sent = run(go())
    assert sent[0]["status"] == 200
    assert eng.pool_stats()["kv_pages_used"] == 0 and eng.pool_stats()["num_running"] == 0
    streamed = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in streamed  # cut short, not completed


def test_json_depth_counts_brackets_outside_strings_only(engine):
    from sglang_tpu_backend.entrypoints.request_fields import MAX_JSON_DEPTH, json_depth

    assert json_depth(b"[" * 5000 + b"]" * 5000) == 5000
    in_strings = json.dumps({"text": "[{" * 5000, "stop": ['\\"[[' * 100]}).encode()
    assert json_depth(in_strings) == 2
    assert json_depth(json.dumps({"a": [[1]] * 1000}).encode()) == 3
    r = run(_post(engine, "/generate", content=json.dumps(
        {"text": "[" * (MAX_JSON_DEPTH + 5), "sampling_params": {"max_new_tokens": 1}})))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs,flag", [
    (dict(max_queued_requests=0), "--max-queued-requests"),
    (dict(watchdog_timeout=0), "--watchdog-timeout"),
    (dict(watchdog_timeout="5"), "--watchdog-timeout"),
])
def test_limit_flags_are_validated(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs)


def _cli_parser():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_flags_without_effect_are_gone_and_help_is_true():
    parser = _cli_parser()
    # SGLang gates /metrics with --enable-metrics; here metrics are always on, and the flag is
    # accepted (RL frameworks pass it) without reaching ServerArgs; its help says so.
    ns = parser.parse_args(["--enable-metrics"])
    assert ns.enable_metrics and not hasattr(ServerArgs.from_cli_args(ns), "enable_metrics")
    helps = {a.dest: a.help or "" for a in parser._actions}
    assert "always on" in helps["enable_metrics"]
    assert "not supported" not in helps["tp_size"] and "tensor-parallel" in helps["tp_size"]
    eng = FakeEngine(ServerArgs(context_length=256))
    assert run(_call_all(eng, [("GET", "/metrics", None)], None))[0].status_code == 200


@pytest.mark.parametrize("kwargs,error", [
    (dict(tp_size=4, ep_size=1), "--ep-size 1 with --tp-size 4"),  # was silently made 4
    (dict(tp_size=4, ep_size=2), "--ep-size 2 with --tp-size 4"),
    (dict(dp_size=2, ep_size=1), "--ep-size 1 with --dp-size 2"),
])
def test_explicit_ep_size_conflict_is_an_error(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ServerArgs(**kwargs)


def test_ep_size_and_queue_defaults():
    from sglang_tpu_backend.server_args import DEFAULT_MAX_QUEUED_REQUESTS

    assert ServerArgs(tp_size=4).ep_size == 4 and ServerArgs(dp_size=2).ep_size == 2
    assert ServerArgs().ep_size == 1
    assert _cli_parser().parse_args([]).max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS
    assert ServerArgs().max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS > 0  # finite


def test_unhealthy_engine_health_is_503_json():
    class Dead(FakeEngine):
        def health_error(self):
            return "the scheduler loop died (test)"

    dead = Dead(ServerArgs(context_length=256))

    async def go():
        async with _client(dead) as c:
            return await c.get("/health"), await c.get("/health_generate")

    for r in run(go()):
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "scheduler loop died" in err["message"]


# Access: --api-key / --admin-api-key (SGLang's semantics, entrypoints/auth.py) -------------
ADMIN_CALLS = [("POST", "/flush_cache", None), ("POST", "/start_profile", {}), ("POST", "/stop_profile", None),
               ("POST", "/update_weights_from_disk", {"model_path": "/anywhere"}),
               ("POST", "/start_expert_distribution_record", None),
               ("POST", "/stop_expert_distribution_record", None),
               ("POST", "/dump_expert_distribution_record", {}),
               ("POST", "/abort_request", {"abort_all": True})]


async def _call_all(eng, calls, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with _client(eng) as c:
        return [await c.request(m, p, json=b, headers=headers) for m, p, b in calls]


@pytest.mark.parametrize("api_key,admin_key,unlocks,refused", [
    ("user", "admin", ["admin"], [None, "user", "wrong"]),  # only the admin key, not the plain one
    (None, "admin", ["admin"], [None, "user"]),
    ("user", None, ["user"], [None, "admin"]),  # no admin key: the plain key guards them
    (None, None, [None], []),  # neither: open (the start-up warning says so)
])
def test_admin_routes_take_the_admin_key(api_key, admin_key, unlocks, refused):
    eng = FakeEngine(ServerArgs(context_length=256, api_key=api_key, admin_api_key=admin_key))
    for key in refused:
        for r in run(_call_all(eng, ADMIN_CALLS, key)):
            _error(r, 401, "authorization")
    assert eng.calls == []  # nothing reached the engine
    for key in unlocks:
        assert [r.status_code for r in run(_call_all(eng, ADMIN_CALLS, key))] == [200] * len(ADMIN_CALLS)
    assert [c[0] for c in eng.calls] == ["flush_cache", "start_profile", "stop_profile",
                                         "update_weights_from_disk",
                                         "start_expert_distribution_record",
                                         "stop_expert_distribution_record",
                                         "dump_expert_distribution_record"] * len(unlocks)


def test_rl_routes_take_the_admin_key_and_answer_501_without_the_engine_calls():
    """SGLang's RL routes (entrypoints/rl_routes.py) are admin routes; an engine without the
    calls (this fake) answers 501 naming the call."""
    eng = FakeEngine(ServerArgs(context_length=256, api_key="user", admin_api_key="admin"))
    calls = [("POST", "/update_weights_from_tensor", {"serialized_named_tensors": "AAAA"}),
             ("POST", "/pause_generation", {"mode": "retract"}), ("POST", "/continue_generation", None),
             ("POST", "/release_memory_occupation", {"tags": None}),
             ("POST", "/resume_memory_occupation", None)]
    for key in (None, "user"):
        for r in run(_call_all(eng, calls, key)):
            _error(r, 401, "authorization")
    for r, (_, path, _) in zip(run(_call_all(eng, calls, "admin")), calls):
        assert r.status_code == 501 and path.strip("/") in r.json()["error"]["message"], r.text


def test_serving_routes_take_the_plain_key_and_probes_stay_open():
    eng = FakeEngine(ServerArgs(context_length=256, api_key="user", admin_api_key="admin"))
    gen = [("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}),
           ("GET", "/get_model_info", None), ("POST", "/abort_request", {"rid": "nope"})]
    assert [r.status_code for r in run(_call_all(eng, gen, "user"))] == [200, 200, 200]
    for r in run(_call_all(eng, gen, "admin")):  # as in SGLang: the admin key is not a user key
        _error(r, 401, "authorization")
    probes = [("GET", "/health", None), ("GET", "/health_generate", None), ("GET", "/metrics", None)]
    assert [r.status_code for r in run(_call_all(eng, probes, None))] == [200, 200, 200]
    info = run(_call_all(eng, [("GET", "/get_server_info", None)], "user"))[0].json()
    assert info["api_key"] == info["admin_api_key"] == "***"


def test_profile_output_dir_is_confined_to_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "link").symlink_to(outside)
    eng = FakeEngine(ServerArgs(context_length=256, profile_dir_root=str(root)))
    for bad in ["../outside", str(outside), "link/trace", str(root / "link"), "/etc"]:
        r = run(_post(eng, "/start_profile", {"output_dir": bad}))
        err = _error(r, 400, "output_dir")
        assert "outside the profile root" in err["message"], err
    assert eng.calls == []
    for good, want in [("sub/trace", root / "sub" / "trace"), (str(root / "abs"), root / "abs"), (None, root)]:
        assert run(_post(eng, "/start_profile", {"output_dir": good})).status_code == 200
        assert eng.calls[-1] == ("start_profile", str(want.resolve()), None)


def test_expert_distribution_dump_is_confined_to_the_root(tmp_path):
    eng = FakeEngine(ServerArgs(context_length=256, profile_dir_root=str(tmp_path)))
    err = _error(run(_post(eng, "/dump_expert_distribution_record", {"output_dir": "/etc"})),
                 400, "output_dir")
    assert "outside the profile root" in err["message"] and eng.calls == []
    r = run(_post(eng, "/dump_expert_distribution_record", {"output_dir": "eplb"}))
    assert r.status_code == 200, r.text
    want = str((tmp_path / "eplb").resolve())
    assert eng.calls == [("dump_expert_distribution_record", want)]
    assert r.json() == {"success": True, "path": want + "/expert_distribution_0.json"}


def test_health_generate_runs_one_probe_at_a_time():
    eng = FakeEngine(ServerArgs(context_length=256))
    eng.health_delay = 0.2

    async def go():
        async with _client(eng) as c:
            return await asyncio.gather(*(c.get("/health_generate") for _ in range(6)))

    assert [r.status_code for r in run(go())] == [200] * 6
    assert eng.health_max_running == 1
    assert eng.calls.count(("health_generate",)) == 1  # the callers shared one probe


def test_an_engine_without_the_engine_api_is_refused():
    from sglang_tpu_backend.entrypoints.engine_protocol import EngineAPI, missing_members

    class NoHealthError:  # the fake engine without health_error
        def __init__(self):
            self._engine = FakeEngine()

        def __getattr__(self, name):
            if name == "health_error":
                raise AttributeError(name)
            return getattr(self._engine, name)

    with pytest.raises(TypeError, match="missing health_error"):
        create_app(NoHealthError())
    assert missing_members(FakeEngine()) == [] and isinstance(FakeEngine(), EngineAPI)


@pytest.mark.parametrize("host,keys,warned", [
    ("0.0.0.0", {}, True), ("10.1.2.3", {}, True), ("::", {}, True),
    ("0.0.0.0", {"api_key": "k"}, False), ("0.0.0.0", {"admin_api_key": "k"}, False),
    ("127.0.0.1", {}, False), ("localhost", {}, False), ("::1", {}, False),
])
def test_startup_warns_when_exposed_without_a_key(monkeypatch, caplog, host, keys, warned):
    from sglang_tpu_backend import launch_server

    monkeypatch.setattr(launch_server._Server, "run", lambda self: None)  # no socket
    args = ServerArgs(context_length=256, host=host, **keys)
    with caplog.at_level("WARNING", logger="sglang_tpu_backend.launch_server"):
        launch_server.serve(args, engine=FakeEngine(args))
    hits = [r for r in caplog.records if "SECURITY WARNING" in r.getMessage()]
    assert bool(hits) == warned
    if warned:
        assert "/update_weights_from_disk" in hits[0].getMessage() and host in hits[0].getMessage()


# Stop strings: capped in count and length (sampling_params.MAX_STOP_STRINGS / _LEN) ---------
def test_stop_string_caps_answer_400_naming_the_field(engine):
    from sglang_tpu_backend.sampling.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

    too_many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    too_long = ["x" * (MAX_STOP_STRING_LEN + 1)]
    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["x" * MAX_STOP_STRING_LEN]
    for stop, what in [(too_many, "stop strings"), (too_long, "characters")]:
        err = _error(run(_post(engine, "/generate", {"text": "a", "sampling_params": {"stop": stop}})),
                     400, "sampling_params.stop")
        assert what in err["message"]
        for path, body in [("/v1/completions", {"model": "m", "prompt": "a", "stop": stop}),
                           ("/v1/chat/completions", {"model": "m", "stop": stop,
                                                     "messages": [{"role": "user", "content": "a"}]})]:
            assert _error(run(_post(engine, path, body)), 400, "stop")["param"] == "stop"
    body = {"text": "a", "sampling_params": {"stop": ok, "max_new_tokens": 2}}
    assert run(_post(engine, "/generate", body)).status_code == 200


def test_flush_cache_succeeds_while_requests_run_and_reports_a_partial_flush():
    eng = FakeEngine(ServerArgs(context_length=256))
    eng.held["running"] = 1  # a running request does not stop a flush (Engine.flush_cache)
    r = run(_post(eng, "/flush_cache"))
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Cache flushed."}
    eng.flush_cache = lambda: False  # a remote engine with a replica that did not flush
    r = run(_post(eng, "/flush_cache"))
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
