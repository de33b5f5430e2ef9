"""The prefix cache through HTTP: ``n=8`` prefills its prompt once, ``cached_tokens`` in the
native ``meta_info`` and in OpenAI ``usage.prompt_tokens_details``, ``/flush_cache`` empties it.
(Live server: page size 16, chunked prefill 64.)"""

from __future__ import annotations

import random

import requests


def random_ids(seed: int, n: int, lo: int, hi: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[lo, hi)`` by one seeded generator."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


def info(server) -> dict:
    return requests.get(server.url + "/get_server_info", timeout=30).json()


def metric(server, name: str) -> float:
    """The value of an unlabelled-by-rank metric on /metrics."""
    for line in requests.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def flushed(server) -> dict:
    server.wait_pools_empty()
    assert requests.post(server.url + "/flush_cache", timeout=30).json()["success"] is True
    s = info(server)
    assert (s["kv_pages_used"], s["kv_pages_cached"], s["gdn_snapshots_used"]) == (0, 0, 0), s
    return s


def test_n8_prefills_the_prompt_once(live_server):
    before = flushed(live_server)["num_prefill_tokens_total"]
    ids = random_ids(11, 1000, 3, 1200)
    r = requests.post(live_server.url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 3, "n": 8, "temperature": 1.0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 8
    last = (1000 - 1) // 16 * 16  # the deepest snapshot point leaves 8 tokens to prefill
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0] + [last] * 7
    s = info(live_server)
    assert s["num_prefill_tokens_total"] - before == 1000 + 7 * (1000 - last)
    hit_rate = metric(live_server, "sglang:cache_hit_rate")
    expected = s["num_cached_tokens_total"] / (s["num_cached_tokens_total"]
                                               + s["num_prefill_tokens_total"])
    assert hit_rate > 0 and abs(hit_rate - expected) < 1e-9, (hit_rate, expected)
    flushed(live_server)


def test_openai_usage_reports_cached_tokens(live_server):
    flushed(live_server)
    ids = random_ids(12, 100, 3, 1200)
    body = {"model": "default", "prompt": ids, "max_tokens": 2, "temperature": 0}
    usages = []
    for _ in range(2):
        r = requests.post(live_server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 96]
    assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] == 100
    flushed(live_server)
