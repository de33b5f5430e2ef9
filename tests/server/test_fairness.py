"""Fairness under a large fan-out: requests are admitted FIFO and one body is capped
(``request_fields.MAX_N``, ``MAX_REQUESTS_PER_BODY``), so while one client's n-sample request
runs, another client's short request still completes before it.

The shared live server runs 8 requests at once (conftest ``--max-running-requests 8``); the
fan-out below is 36 samples of 16 tokens, so at least four waves queue behind the first and the
short request joins the last, partly empty one (or an earlier slot) and finishes first.
"""

from __future__ import annotations

import threading
import time

import requests


def test_short_request_completes_while_a_large_fanout_runs(live_server):
    url = live_server.url
    n = 36
    big: dict = {}

    def fanout():
        big["response"] = requests.post(url + "/generate", timeout=600, json={
            "text": "Once upon a time", "sampling_params": {
                "n": n, "max_new_tokens": 16, "ignore_eos": True, "temperature": 0.8}})
        big["done"] = time.monotonic()

    t = threading.Thread(target=fanout)
    t.start()
    try:
        deadline = time.monotonic() + 120
        while live_server.pool_stats()["num_queued"] == 0:  # the fan-out is queued behind 8 running
            assert t.is_alive() and time.monotonic() < deadline, "the fan-out never queued"
            time.sleep(0.02)
        small = requests.post(url + "/generate", timeout=600, json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        small_done = time.monotonic()
        fanout_still_running = t.is_alive()
    finally:
        t.join(600)
    assert small.status_code == 200, small.text
    assert small.json()["meta_info"]["finish_reason"] is not None
    assert fanout_still_running and small_done < big["done"]
    outs = big["response"].json()
    assert big["response"].status_code == 200 and len(outs) == n
    assert all(len(o["output_ids"]) == 16 for o in outs)
    assert live_server.wait_pools_empty()["kv_pages_used"] == 0
