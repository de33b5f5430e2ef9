"""Engine metrics: after N requests the counters equal N and the summed token counts, every
histogram counts each request (or each output token after the first) exactly once, aborted and
retracted requests are counted, and the in-step router stats are sane.

Uses the shared engine (conftest), so every check is a delta between two scrapes.
"""

from __future__ import annotations

import asyncio
import math
import random

from prometheus_client.parser import text_string_to_metric_families

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from tests.engine.conftest import small_page_pool


def scrape(engine) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics exposition."""
    out = {}
    for fam in text_string_to_metric_families(engine.metrics_text().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def delta(before, after, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def prompts(seed, n, lo, hi):
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def req(ids, n, stream=False):
    return GenerateReqInput(input_ids=ids, stream=stream, sampling_params={
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True})


async def run_all(engine, objs):
    async def one(o):
        return [x async for x in engine.generate_request(o)][-1]
    return await asyncio.gather(*(one(o) for o in objs))


def test_counters_and_histograms_after_n_requests(clean_engine):
    eng = clean_engine
    ps = prompts(11, 6, 5, 40)
    news = [3, 5, 1, 7, 4, 2]
    before = scrape(eng)
    asyncio.run(run_all(eng, [req(p, n) for p, n in zip(ps, news)]))
    after = scrape(eng)
    N = len(ps)
    assert delta(before, after, "sglang:num_requests_total") == N
    assert delta(before, after, "sglang:num_requests_by_finish_reason_total", reason="length") == N
    assert delta(before, after, "sglang:prompt_tokens_total") == sum(map(len, ps))
    assert delta(before, after, "sglang:generation_tokens_total") == sum(news)
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        assert delta(before, after, f"sglang:{h}_count") == N, h
        assert delta(before, after, f"sglang:{h}_bucket", le="+Inf") == N, h
    # One inter-token interval per output token after the first.
    assert delta(before, after, "sglang:inter_token_latency_seconds_count") == sum(news) - N
    labels = {dict(lab).get("role") for (n, lab) in after if n.startswith("sglang:")}
    assert labels == {"colocated"}
    assert value(after, "sglang:num_running_reqs", dp_rank="0") == 0
    assert value(after, "sglang:kv_pages_total", dp_rank="0") == eng.num_pages_per_rank


def test_aborted_requests_are_counted(clean_engine):
    eng = clean_engine
    before = scrape(eng)

    async def go():
        agen = eng.generate_request(req(prompts(3, 1, 20, 20)[0], 50, stream=True))
        await agen.__anext__()  # first token streamed, then the client goes away
        await agen.aclose()
    asyncio.run(go())
    after = scrape(eng)
    assert delta(before, after, "sglang:num_aborted_requests_total") == 1
    assert delta(before, after, "sglang:num_requests_by_finish_reason_total", reason="abort") == 1
    assert delta(before, after, "sglang:num_requests_total") == 1
    assert delta(before, after, "sglang:e2e_request_latency_seconds_count") == 1


def test_retracted_requests_are_counted_once_per_retraction(clean_engine):
    eng = clean_engine
    ps = prompts(5, 12, 10, 20)
    before = scrape(eng)
    retracted_before = eng.pool_stats()["num_retracted_total"]
    with small_page_pool(eng, 14):  # a 14-page (224-token) pool: 12 requests need ~36 pages
        asyncio.run(run_all(eng, [req(p, 24) for p in ps]))
    after = scrape(eng)
    retractions = eng.pool_stats()["num_retracted_total"] - retracted_before
    assert retractions > 0
    assert delta(before, after, "sglang:num_retracted_reqs_total") == retractions
    # A retracted request is still one request with one first token and one queue time.
    for h in ("time_to_first_token_seconds", "queue_time_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, f"sglang:{h}_count") == len(ps), h
    assert delta(before, after, "sglang:generation_tokens_total") == 24 * len(ps)


def test_router_health_gauges_are_in_range(clean_engine):
    eng = clean_engine
    asyncio.run(run_all(eng, [req(p, 4) for p in prompts(7, 4, 8, 30)]))
    s = scrape(eng)
    E, K = eng.model_config.num_experts, eng.model_config.num_experts_per_tok
    for layer in range(eng.model_config.num_hidden_layers):
        lab = dict(layer=str(layer), dp_rank="0")
        ratio = value(s, "sglang:expert_load_max_mean_ratio", **lab)
        ent = value(s, "sglang:router_entropy", **lab)
        top1 = value(s, "sglang:router_top1_prob", **lab)
        assert 1.0 <= ratio <= E / K + 1e-6, (layer, ratio)
        assert 0.0 < ent <= math.log(E) + 1e-5, (layer, ent)
        assert 1.0 / E - 1e-6 <= top1 <= 1.0, (layer, top1)
