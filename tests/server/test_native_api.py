"""SGLang-native routes against a live server: /generate (single, batch, n > 1, streaming,
logprobs), /get_model_info, /get_server_info, /abort_request, /flush_cache, health checks."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from sglang_tpu_backend.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(live_server):
    info = requests.get(live_server.url + "/get_model_info", timeout=30).json()
    return load_tokenizer(info["tokenizer_path"] or info["model_path"])


def gen(server, body, timeout=120, **kw):
    return requests.post(server.url + "/generate", json=body, timeout=timeout, **kw)


def sse(resp) -> list[dict]:
    """Parse an SGLang event stream; asserts the framing and the final [DONE]."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.content.decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), blocks[:3]
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def test_model_info(live_server):
    info = requests.get(live_server.url + "/get_model_info", timeout=30).json()
    assert info["is_generation"] is True
    assert isinstance(info["model_path"], str) and info["model_path"]
    assert "tokenizer_path" in info


def test_server_info_and_health(live_server):
    info = requests.get(live_server.url + "/get_server_info", timeout=30).json()
    stats = info["pool_stats"]
    for key in ("kv_pages_used", "kv_pages_total", "state_slots_used", "state_slots_total", "num_running"):
        assert isinstance(stats[key], int)
    assert stats["kv_pages_total"] > 0 and stats["state_slots_total"] > 0
    assert requests.get(live_server.url + "/health", timeout=30).status_code == 200
    assert requests.get(live_server.url + "/health_generate", timeout=120).status_code == 200


def test_generate_single_text(live_server, tok):
    prompt = "The capital of France is"
    r = gen(live_server, {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                             "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(tok.encode(prompt))
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert isinstance(meta["id"], str) and meta["id"]


def test_generate_input_ids_matches_text(live_server, tok):
    prompt = "one two three"
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    a = gen(live_server, {"text": prompt, "sampling_params": sp}).json()
    b = gen(live_server, {"input_ids": tok.encode(prompt), "sampling_params": sp}).json()
    assert a["output_ids"] == b["output_ids"]  # greedy: same prompt tokens, same output


def test_generate_batch_order(live_server, tok):
    prompts = ["a", "a much longer prompt with more tokens in it", "mid length prompt"]
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    outs = gen(live_server, {"text": prompts, "sampling_params": sp}).json()
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(tok.encode(p)) for p in prompts]
    singles = [gen(live_server, {"text": p, "sampling_params": sp}).json()["output_ids"] for p in prompts]
    assert [o["output_ids"] for o in outs] == singles


def test_generate_n_parallel_sampling(live_server):
    body = {"input_ids": [[10, 11, 12], [20, 21, 22, 23, 24]],
            "sampling_params": {"max_new_tokens": 8, "n": 3, "temperature": 1.0, "ignore_eos": True}}
    outs = gen(live_server, body).json()
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 3, 5, 5, 5]  # prompt-major order
    # distinct seeds per sample: 3 samples of 8 tokens at temperature 1 do not all coincide
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1
    assert len({tuple(o["output_ids"]) for o in outs[3:]}) > 1
    # a fixed seed makes the n samples reproducible
    body["sampling_params"]["seed"] = 42
    a, b = gen(live_server, body).json(), gen(live_server, body).json()
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]


def test_generate_stream(live_server, tok):
    body = {"text": "Streaming test:", "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    with gen(live_server, body, stream=True) as r:
        assert r.status_code == 200
        chunks = sse(r)
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    assert all("finish_reason" not in c["meta_info"] or c["meta_info"]["finish_reason"] is None
               for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == 8
    nonstream = gen(live_server, {**body, "stream": False}).json()
    assert last["text"] == nonstream["text"]


def test_logprobs_shapes(live_server, tok):
    prompt = "logprob shapes are checked here"
    n_prompt = len(tok.encode(prompt))
    body = {"text": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    out = gen(live_server, body).json()
    m = out["meta_info"]
    inp, outp = m["input_token_logprobs"], m["output_token_logprobs"]
    assert len(inp) == n_prompt and len(outp) == 4
    assert inp[0][0] is None  # nothing predicts the first prompt token
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in inp[1:] + outp)
    assert [e[1] for e in inp] == tok.encode(prompt)
    assert [e[1] for e in outp] == out["output_ids"]
    assert all(isinstance(e[2], str) for e in outp)
    assert len(m["output_top_logprobs"]) == 4 and all(len(t) == 3 for t in m["output_top_logprobs"])
    assert len(m["input_top_logprobs"]) == n_prompt
    assert all(len(t) == 3 for t in m["input_top_logprobs"][1:])
    # greedy: the chosen token is the top-1 candidate
    for e, top in zip(outp, m["output_top_logprobs"]):
        assert top[0][1] == e[1] and abs(top[0][0] - e[0]) < 1e-4
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_logprob_start_len_select_style(live_server, tok):
    """What ``sgl.select`` sends: max_new_tokens 0, logprobs from prompt_tokens - 2."""
    texts = ["Answer: True", "Answer: False"]
    n = [len(tok.encode(t)) for t in texts]
    body = {"text": texts, "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": min(n) - 2, "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    outs = gen(live_server, body).json()
    for o, k in zip(outs, n):
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        assert len(o["meta_info"]["input_token_logprobs"]) == k - (min(n) - 2)


def test_stream_logprobs_incremental(live_server):
    body = {"text": "inc", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with gen(live_server, body, stream=True) as r:
        chunks = sse(r)
    total = 0
    for c in chunks:
        m = c["meta_info"]
        assert m["output_token_logprobs_length"] == m["completion_tokens"]
        assert len(m["output_token_logprobs"]) == m["completion_tokens"] - total
        total = m["completion_tokens"]
    assert total == 6


def test_abort_request(live_server):
    rid = "abort-me-1"
    result = {}

    def run():
        result["r"] = gen(live_server, {"text": "long", "rid": rid,
                                        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}},
                          timeout=300)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while live_server.pool_stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    ok = requests.post(live_server.url + "/abort_request", json={"rid": rid}, timeout=30)
    assert ok.status_code == 200 and ok.json()["success"] is True
    t.join(timeout=120)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 1500
    stats = live_server.wait_pools_empty()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
    unknown = requests.post(live_server.url + "/abort_request", json={"rid": "no-such"}, timeout=30)
    assert unknown.status_code == 200 and unknown.json()["success"] is False


def test_flush_cache(live_server):
    live_server.wait_pools_empty()
    r = requests.post(live_server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True


def test_return_routed_experts_needs_the_server_flag(live_server):
    """``return_routed_experts`` on a server without --enable-return-routed-experts: 400 naming
    the field; a malformed value too."""
    r = gen(live_server, {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                          "return_routed_experts": True})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "return_routed_experts"
    assert "--enable-return-routed-experts" in err["message"]
    bad = gen(live_server, {"text": "hi", "return_routed_experts": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_routed_experts"
