"""The offline API (``sglang_tpu_backend.Engine`` as ``sglang.Engine``), ``get_load`` and the
step-bounded profiler, on the shared tiny engine (and one that the test steps itself)."""

from __future__ import annotations

import asyncio
import glob

import pytest

from tests.engine.conftest import ENGINE_ARGS, wait_pools_empty

from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def offline(engine):
    """The offline API over the shared engine (closing it leaves the engine running)."""
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine

    api = OfflineEngine(engine=engine)
    yield api
    api.close()


@pytest.fixture
def clean_offline(offline, clean_engine):
    yield offline


def test_package_exports_the_offline_engine():
    import sglang_tpu_backend
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine

    assert sglang_tpu_backend.Engine is OfflineEngine


def test_single_and_batch_shapes(clean_offline, clean_engine):
    one = clean_offline.generate("offline one", GREEDY)
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert one["meta_info"]["completion_tokens"] == len(one["output_ids"]) == 6
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    batch = clean_offline.generate(["offline one", "offline two"], GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]  # greedy: the batch does not change it
    ids = clean_engine.tokenizer.encode("offline one")
    by_ids = clean_offline.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == one["output_ids"]
    n = clean_offline.generate("offline n", {"max_new_tokens": 4, "temperature": 1.0, "n": 2, "seed": 5})
    assert isinstance(n, list) and len(n) == 2  # n > 1: a list, as /generate answers


def test_stream_and_async_match_non_stream(clean_offline, clean_engine):
    sp = {"max_new_tokens": 8, "temperature": 0.8, "seed": 11}
    ref = clean_offline.generate("stream me", sp, return_logprob=True)
    chunks = list(clean_offline.generate("stream me", sp, return_logprob=True, stream=True))
    assert len(chunks) > 1 and chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["output_ids"] == ref["output_ids"]
    # Output logprobs stream incrementally (as the route's chunks): together they are the list.
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert streamed == ref["meta_info"]["output_token_logprobs"]

    async def run():
        out = await clean_offline.async_generate("stream me", sp, return_logprob=True)
        agen = await clean_offline.async_generate("stream me", sp, stream=True)
        return out, [c async for c in agen]

    out, achunks = asyncio.run(run())
    assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
    assert achunks[-1]["text"] == ref["text"]
    batch = list(clean_offline.generate(["s one", "s two"], GREEDY, stream=True))
    assert {c["index"] for c in batch} == {0, 1}


def test_sync_generate_inside_a_running_event_loop(clean_offline, clean_engine):
    """A sync call from a coroutine (a notebook cell) runs on the engine's own loop."""
    ref = clean_offline.generate("loop inside", GREEDY)

    async def inside():
        return clean_offline.generate("loop inside", GREEDY)

    assert asyncio.run(inside())["output_ids"] == ref["output_ids"]


def test_leaving_a_stream_early_aborts(clean_offline, clean_engine):
    it = clean_offline.generate("leave early", {"max_new_tokens": 100, "temperature": 0}, stream=True)
    next(it)
    it.close()
    s = wait_pools_empty(clean_engine)
    assert s["kv_pages_used"] == 0 and s["num_running"] == 0


def test_bad_input_raises_naming_the_field(clean_offline, clean_engine):
    with pytest.raises(InvalidRequestError) as e:
        clean_offline.generate("x", {"temperature": -1})
    assert e.value.field == "sampling_params.temperature"
    with pytest.raises(InvalidRequestError) as e:
        clean_offline.generate()
    assert e.value.field == "text"
    with pytest.raises(InvalidRequestError) as e:
        clean_offline.generate("x", lora_path="adapter")
    assert e.value.field == "lora_path"
    with pytest.raises(TypeError, match="generate_request"):
        clean_offline.generate(GenerateReqInput(text="x"))


def test_constructor_forms(engine):
    from sglang_tpu_backend import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    with pytest.raises(TypeError, match="not both"):
        Engine(ServerArgs(), dtype="float32")
    with pytest.raises(TypeError):
        Engine(no_such_flag=1)


def test_context_manager_stops_the_threads():
    from sglang_tpu_backend import Engine

    with Engine(**ENGINE_ARGS) as eng:
        out = eng.generate("context", GREEDY)
        threads = (eng.engine.loop.thread, eng._offline_thread)
        assert all(t.is_alive() for t in threads)
    assert out["meta_info"]["completion_tokens"] == 6
    assert not any(t.is_alive() for t in threads)


@pytest.fixture(scope="module")
def stepped():
    """An engine whose steps the test drives (``start_loop=False``): known states."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**ENGINE_ARGS), start_loop=False)
    yield eng
    eng.shutdown()


def test_get_load_counts_running_waiting_and_tokens(stepped):
    P = stepped.args.page_size
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 7)]
    reqs = [stepped.add_request(GenerateReqInput(input_ids=p, sampling_params={
        "max_new_tokens": 4, "temperature": 0})) for p in prompts]
    assert stepped.get_load() == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 3,
                                   "num_tokens": 32}]
    stepped.step()  # admits all three, prefills them, samples one token each
    # One page each: 5 and 7 prompt tokens + the sampled one; the 20-token prompt's first
    # chunk ends at the GDN snapshot point after 16 tokens (prefix cache).
    assert [len(r.pages) for r in reqs] == [1, 1, 1] and [r.num_computed for r in reqs] == [5, 16, 7]
    pages = 3
    assert stepped.pool_stats()["kv_pages_used"] == pages
    assert stepped.get_load() == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 0,
                                   "num_tokens": pages * P}]
    for r in reqs:
        stepped.abort_request(r.rid)
    stepped.flush_cache()
    assert stepped.get_load()[0] == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_profile_stops_after_num_steps(stepped, tmp_path):
    stepped.start_profile(str(tmp_path), num_steps=2)
    with pytest.raises(InvalidRequestError, match="already in progress"):
        stepped.start_profile(str(tmp_path))
    req = stepped.add_request(GenerateReqInput(input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 8, "temperature": 0}))
    stepped.step()
    assert stepped.loop.profiler.running  # one step of two
    stepped.step()
    assert not stepped.loop.profiler.running  # stopped by itself after the second step
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    with pytest.raises(InvalidRequestError, match="not in progress"):
        stepped.stop_profile()
    with pytest.raises(InvalidRequestError) as e:
        stepped.start_profile(str(tmp_path), num_steps=0)
    assert e.value.field == "num_steps"
    stepped.abort_request(req.rid)
