"""Engine on the embedded tiny model: batching equals running alone, retraction, prompt
logprobs against the model's own logits, streaming, stop strings, aborts, validation.

All tests share one Engine (conftest) and check that its pools return to empty.
"""

from __future__ import annotations

import asyncio
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from tests.engine.conftest import small_page_pool, wait_pools_empty


def collect(engine, obj):
    """All outputs of one request (runs its own event loop)."""
    async def go():
        return [o async for o in engine.generate_request(obj)]
    return asyncio.run(go())


def greedy(ids, n, **kw):
    return GenerateReqInput(input_ids=list(ids), sampling_params={"max_new_tokens": n, "temperature": 0, **kw})


async def run_all(engine, objs):
    async def one(o):
        return [x async for x in engine.generate_request(o)][-1]
    return await asyncio.gather(*(one(o) for o in objs))


def random_prompts(seed, n, lo, hi, vocab=1024):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_64_concurrent_requests_equal_running_alone(clean_engine):
    eng = clean_engine
    rng = random.Random(0)
    prompts = random_prompts(0, 64, 2, 12)
    lens = [rng.randint(1, 6) for _ in prompts]
    objs = [greedy(p, n, ignore_eos=True) for p, n in zip(prompts, lens)]
    batched = asyncio.run(run_all(eng, objs))
    alone = [collect(eng, greedy(p, n, ignore_eos=True))[-1] for p, n in zip(prompts, lens)]
    for b, a, n in zip(batched, alone, lens):
        assert b["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert len(b["output_ids"]) == n
        assert b["output_ids"] == a["output_ids"]
        assert b["text"] == a["text"]


def test_retraction_with_small_kv_pool_keeps_outputs(clean_engine):
    eng = clean_engine
    prompts = random_prompts(1, 12, 10, 20)
    objs = [greedy(p, 24, ignore_eos=True) for p in prompts]
    alone = [collect(eng, o)[-1]["output_ids"] for o in objs]
    # Serve from a 14-page (224-token) subset of the KV cache: 12 requests need ~36 pages.
    before = eng.pool_stats()["num_retracted_total"]
    with small_page_pool(eng, 14):
        batched = asyncio.run(run_all(eng, [greedy(p, 24, ignore_eos=True) for p in prompts]))
    assert eng.pool_stats()["num_retracted_total"] > before
    assert [b["output_ids"] for b in batched] == alone


def model_logprobs(eng, ids):
    """log_softmax of the model's own logits at every prompt row, one forward on a fresh cache."""
    from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
    from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

    cfg, ps = eng.model_config, eng.args.page_size
    n_pages = -(-len(ids) // ps)
    cache = init_cache(cfg, num_pages=n_pages, page_size=ps, num_state_slots=1,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    fb, _ = build_forward_batch([SeqChunk(ids, 0, list(range(n_pages)), 0, "all")], page_size=ps)
    logits, _ = forward_jit(eng.runner.params, cache, fb, cfg=cfg, impl=eng.runner.backend.impl)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_prompt_logprobs_equal_model_log_softmax(clean_engine):
    eng = clean_engine
    ids = random_prompts(2, 1, 90, 90)[0]  # longer than one 64-token chunk
    start = 5
    obj = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0},
                           return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
    out = collect(eng, obj)[-1]["meta_info"]
    ref = model_logprobs(eng, ids)
    inp = out["input_token_logprobs"]
    assert len(inp) == len(ids) - start and inp[0][0] is None
    assert [t for _, t, _ in inp] == ids[start:]
    got = np.array([lp for lp, _, _ in inp[1:]])
    want = ref[np.arange(start, len(ids) - 1), ids[start + 1:]]
    np.testing.assert_allclose(got, want, atol=2e-4)
    tops = out["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(inp)
    for row, top in zip(range(start, len(ids) - 1), tops[1:]):
        assert [t for _, t, _ in top] == list(np.argsort(-ref[row])[:3])
    # The first output token's logprob is the last prompt row's (greedy: its max).
    lp0, tok0, _ = out["output_token_logprobs"][0]
    assert tok0 == int(np.argmax(ref[-1])) and abs(lp0 - ref[-1].max()) < 2e-4


def test_select_style_prompt_only_request(clean_engine):
    ids = random_prompts(3, 1, 12, 12)[0]
    obj = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=len(ids) - 2)
    out = collect(clean_engine, obj)[-1]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    inp = out["meta_info"]["input_token_logprobs"]
    assert len(inp) == 2 and inp[0][0] is None and inp[1][0] < 0


def test_streaming_is_cumulative_and_matches_non_stream(clean_engine):
    eng = clean_engine
    text = "The quick brown fox"
    full = collect(eng, GenerateReqInput(text=text, sampling_params={"max_new_tokens": 6, "temperature": 0}))
    assert len(full) == 1
    chunks = collect(eng, GenerateReqInput(text=text, stream=True,
                                           sampling_params={"max_new_tokens": 6, "temperature": 0}))
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == full[0]["output_ids"] and chunks[-1]["text"] == full[0]["text"]


def test_streamed_logprobs_are_prefixes_of_the_final_output(clean_engine):
    """Outputs are built incrementally: every streamed output keeps its own lengths (none is
    changed by later steps), is a prefix of the final one, and the final equals non-stream."""
    eng = clean_engine
    kw = dict(input_ids=[5, 9, 17, 33, 65], return_logprob=True, logprob_start_len=1, top_logprobs_num=2,
              return_text_in_logprobs=True,
              sampling_params={"max_new_tokens": 8, "temperature": 0.8, "seed": 7, "ignore_eos": True})
    chunks = collect(eng, GenerateReqInput(stream=True, **kw))
    full = collect(eng, GenerateReqInput(**kw))[-1]
    last = chunks[-1]["meta_info"]
    assert len(chunks) >= 2 and len(last["output_token_logprobs"]) == 8
    for c in chunks:
        meta, n = c["meta_info"], len(c["output_ids"])
        assert meta["completion_tokens"] == n
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert len(meta[key]) == n and meta[key] == last[key][:n]
        for key in ("input_token_logprobs", "input_top_logprobs"):
            assert meta[key] == last[key]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert last[key] == full["meta_info"][key]
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
    assert [[lp, t, eng.tokenizer.decode([t])] for lp, t, _ in last["output_token_logprobs"]] == \
        last["output_token_logprobs"]
    assert len(last["input_token_logprobs"]) == 4 and last["input_top_logprobs"][0] is None


def test_output_snapshot_materialises_the_lengths_at_delivery(clean_engine):
    """``_output`` (under the engine lock) only measures the cumulative lists; the consumer
    copies them later, after more tokens were appended, and still gets the delivery's state."""
    eng = clean_engine
    req = eng.requests.build(GenerateReqInput(
        input_ids=[5, 9, 17], return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
        sampling_params={"max_new_tokens": 8}))
    req.input_logprobs = [-0.5, -0.25]
    req.input_top_logprobs = [[(-0.5, 4), (-1.0, 6)], [(-0.25, 17), (-2.0, 3)]]

    def step(tok):
        req.output_ids.append(tok)
        req.output_logprobs.append(-0.1 * tok)
        req.output_top_logprobs.append([(-0.1 * tok, tok), (-3.0, 1)])
        req.update_text()
        return eng.outputs.snapshot(req)

    first = step(7)
    second = step(8)
    step(9)  # appended before either is materialised
    a, b = first.materialize(), second.materialize()
    assert a["output_ids"] == [7] and b["output_ids"] == [7, 8]
    assert [e[1] for e in a["meta_info"]["output_token_logprobs"]] == [7]
    assert [e[1] for e in b["meta_info"]["output_token_logprobs"]] == [7, 8]
    assert len(a["meta_info"]["output_top_logprobs"]) == 1 and a["meta_info"]["completion_tokens"] == 1
    assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
    assert len(a["meta_info"]["input_token_logprobs"]) == 3  # [None, 5, ...] + two logprobs
    b["output_ids"].append(99)  # a materialised output is the consumer's own copy
    assert second.materialize()["output_ids"] == [7, 8]


def test_stop_string_trims_text(clean_engine):
    eng = clean_engine
    ids = random_prompts(4, 1, 6, 6)[0]
    ref = collect(eng, greedy(ids, 12, ignore_eos=True))[-1]
    text = ref["text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("reference text too short for a stop string")
    out = collect(eng, greedy(ids, 12, ignore_eos=True, stop=[stop]))[-1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]


def test_seeded_sampling_reproducible(clean_engine):
    ids = random_prompts(5, 1, 5, 5)[0]
    sp = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    a = collect(clean_engine, GenerateReqInput(input_ids=ids, sampling_params=sp))[-1]["output_ids"]
    b = collect(clean_engine, GenerateReqInput(input_ids=ids, sampling_params=sp))[-1]["output_ids"]
    c = collect(clean_engine, GenerateReqInput(input_ids=ids, sampling_params={**sp, "seed": 99}))[-1]["output_ids"]
    assert a == b and a != c


def test_consumer_exit_aborts_and_frees_at_once(clean_engine):
    eng = clean_engine

    async def go():
        gen = eng.generate_request(GenerateReqInput(input_ids=[5, 6, 7], stream=True, rid="leaver",
                                            sampling_params={"max_new_tokens": 100, "ignore_eos": True}))
        first = await gen.__anext__()
        assert first["meta_info"]["finish_reason"] is None
        await gen.aclose()
        return eng.pool_stats()

    stats = asyncio.run(go())
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0


def test_abort_request_sends_abort_finish(clean_engine):
    eng = clean_engine

    async def go():
        outs = []
        async for o in eng.generate_request(GenerateReqInput(input_ids=[8, 9], stream=True, rid="victim",
                                                     sampling_params={"max_new_tokens": 100, "ignore_eos": True})):
            outs.append(o)
            if len(outs) == 2:
                assert eng.abort_request("victim")
        return outs

    outs = asyncio.run(go())
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert not eng.abort_request("victim")


@pytest.mark.parametrize("kwargs,field", [
    (dict(text="hi", input_ids=[1, 2]), "text"),
    (dict(), "text"),
    (dict(input_ids=[1, 5000]), "input_ids"),
    (dict(input_ids=[]), "input_ids"),
    (dict(input_ids=list(range(3, 200))), "input_ids"),  # longer than the context (128)
    (dict(input_ids=[3, 4], sampling_params={"max_new_tokens": 200}), "sampling_params.max_new_tokens"),
    (dict(input_ids=[3, 4], sampling_params={"temperature": -1}), "sampling_params.temperature"),
    (dict(input_ids=[3, 4], sampling_params={"regex": "[a-"}), "sampling_params.regex"),
    (dict(input_ids=[3, 4], sampling_params={"json_schema": "{not json"}), "sampling_params.json_schema"),
    (dict(input_ids=[3, 4], top_logprobs_num=1000), "top_logprobs_num"),
])
def test_validation_errors_name_the_field(clean_engine, kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        collect(clean_engine, GenerateReqInput(**kwargs))
    assert e.value.field == field
    assert clean_engine.pool_stats()["num_queued"] == 0


def test_info_and_health(clean_engine):
    eng = clean_engine
    info = eng.get_model_info()
    assert info["is_generation"] is True and info["model_path"]
    s = eng.get_server_info()
    assert s["max_running_requests"] == 64 and "num_retracted_reqs" in s
    assert asyncio.run(eng.health_generate()) is True
    assert eng.flush_cache() is True
    assert wait_pools_empty(eng)["kv_pages_total"] == eng.num_pages
