"""Weight updates without a restart (``Engine.update_weights_from_disk``, ``POST
/update_weights_from_disk``): the new weights give exactly a fresh engine's outputs and compile
nothing; requests in flight finish on the old weights (or are aborted), requests arriving
meanwhile wait and run on the new ones; a mismatched checkpoint is refused and changes nothing.

Checkpoint "B" is the tiny model's config with weights from another seed
(``tiny_model.write_random_model``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.engine.conftest import ENGINE_ARGS, wait_pools_empty
from tests.engine.engine_runs import GREEDY, LONG, PROMPTS, TIMEOUT_S
from tests.engine.engine_runs import final as _final
from tests.engine.engine_runs import req as _req
from tests.engine.engine_runs import run_each as _run_each
from tests.engine.engine_runs import tokens_and_logprobs as _tokens_and_logprobs



@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path, write_random_model

    def wider(config, tensors):
        config["text_config"]["hidden_size"] *= 2

    def missing(config, tensors):
        del tensors["model.language_model.norm.weight"]

    def shorter(config, tensors):
        tensors["model.language_model.norm.weight"] = tensors["model.language_model.norm.weight"][:-1]

    root = tmp_path_factory.mktemp("weights")
    return {"a": default_model_path(), "b": write_random_model(root / "b", seed=1),
            "wider": write_random_model(root / "wider", seed=1, edit=wider),
            "missing": write_random_model(root / "missing", seed=1, edit=missing),
            "shorter": write_random_model(root / "shorter", seed=1, edit=shorter)}


@pytest.fixture(scope="module")
def eng():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS))
    yield e
    e.fault_injector = None
    e.shutdown()


@pytest.fixture(scope="module")
def eng_sync():
    """An engine that completes each step before launching the next (no overlap)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS, disable_overlap_schedule=True))
    yield e
    e.fault_injector = None
    e.shutdown()






@pytest.fixture(scope="module")
def reference(ckpts):
    """Outputs of a fresh engine on each checkpoint: PROMPTS (GREEDY) and PROMPTS[0] (LONG)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    refs = {}
    for name in ("a", "b"):
        e = Engine(ServerArgs(**ENGINE_ARGS, model_path=str(ckpts[name])))
        try:
            greedy = _tokens_and_logprobs(_run_each(e))
            e.flush_cache()  # the long request below prefills from scratch, as in the tests
            refs[name] = (greedy, _run_each(e, PROMPTS[:1], LONG)[0]["output_ids"])
        finally:
            e.shutdown()
    assert refs["a"][0] != refs["b"][0], "seed 1 weights give the same outputs as seed 0"
    return refs


def _use(engine, path):
    res = engine.update_weights_from_disk(str(path))
    assert res["success"], res


def _idle(engine):
    s = wait_pools_empty(engine)
    assert (s["kv_pages_used"], s["state_slots_used"], s["num_running"], s["num_queued"]) == (0, 0, 0, 0), s
    return s


@pytest.fixture
def new_engine():
    """An engine serving its startup weights (no update yet: the compile count below compares
    the swapped-in arrays with the ones the engine placed itself)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS))
    yield e
    e.shutdown()


def test_update_matches_fresh_engine_without_recompiling(new_engine, ckpts, reference):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    eng = new_engine
    assert _tokens_and_logprobs(_run_each(eng)) == reference["a"][0]
    assert _idle(eng)["kv_pages_cached"] > 0  # the prompts are cached (old-weight KV)
    client = TestClient(create_app(eng))
    before = client.get("/get_weight_version").json()["weight_version"]
    r = client.post("/update_weights_from_disk", json={"model_path": str(ckpts["b"])})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert r.json()["num_paused_requests"] == 0
    s = _idle(eng)
    assert (s["kv_pages_cached"], s["gdn_snapshots_used"]) == (0, 0), s  # flushed at the swap
    version = client.get("/get_model_info").json()["weight_version"]
    assert version != before and client.get("/get_weight_version").json() == {"weight_version": version}
    assert client.get("/get_server_info").json()["weight_version"] == version

    counter = CompileCounter()
    outs = _run_each(eng)
    assert counter.lowerings == 0 and counter.backend_compiles == 0, "the swap made steps recompile"
    assert _tokens_and_logprobs(outs) == reference["b"][0]  # tokens and logprobs exactly
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]  # no old-weight KV reused

    r = client.post("/update_weights_from_disk",
                    json={"model_path": str(ckpts["a"]), "weight_version": "base"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert eng.get_model_info()["weight_version"] == "base"
    assert _tokens_and_logprobs(_run_each(eng)) == reference["a"][0]  # back to the old model
    _idle(eng)


class Gate:
    """``fault_injector`` that parks the loop thread at the start of a step's model phase
    while closed (outside the engine lock: requests and updates still get in)."""

    def __init__(self):
        self.open = threading.Event()
        self.open.set()
        self.parked = threading.Event()

    def __call__(self, phase):
        if phase == "model" and not self.open.is_set():
            self.parked.set()
            assert self.open.wait(TIMEOUT_S)

    def close(self):
        self.parked.clear()
        self.open.clear()


async def _until(pred, what):
    deadline = time.monotonic() + TIMEOUT_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _first_token_then(engine, obj, outs: list):
    """Stream ``obj`` into ``outs`` (every chunk)."""
    async for o in engine.generate_request(obj):
        outs.append(o)


async def _update_pending_mid_stream(eng, gate: Gate, ckpt):
    """A long request streaming, the loop parked at ``gate``, then an update to ``ckpt``
    started and pending. Returns (long request task, its chunks, update task)."""
    long_outs: list = []
    long_task = asyncio.ensure_future(_first_token_then(eng, _req(PROMPTS[0], LONG, stream=True), long_outs))
    await _until(lambda: long_outs, "the long request's first token")
    gate.close()
    await _until(gate.parked.is_set, "the loop to park")
    update = asyncio.ensure_future(asyncio.to_thread(eng.update_weights_from_disk, str(ckpt)))
    await _until(lambda: eng.weights.pending is not None, "the update to be pending")
    return long_task, long_outs, update


@pytest.mark.parametrize("engine_fixture", ["eng", "eng_sync"])
def test_inflight_requests_finish_on_old_weights(request, engine_fixture, ckpts, reference):
    eng = request.getfixturevalue(engine_fixture)
    assert eng.overlap == (engine_fixture == "eng")
    _use(eng, ckpts["a"])
    gate = Gate()
    eng.fault_injector = gate

    async def scenario():
        long_task, long_outs, update = await _update_pending_mid_stream(eng, gate, ckpts["b"])
        new = asyncio.ensure_future(_final(eng, _req(PROMPTS[0], GREEDY, return_logprob=True)))
        await _until(lambda: eng.pool_stats()["num_queued"] == 1, "the new request to be held")
        assert not long_task.done() and not update.done()
        gate.open.set()
        res = await asyncio.wait_for(update, TIMEOUT_S)
        await asyncio.wait_for(long_task, TIMEOUT_S)
        return res, long_outs[-1], await asyncio.wait_for(new, TIMEOUT_S)

    try:
        res, long_out, new_out = asyncio.run(scenario())
    finally:
        eng.fault_injector = None
        gate.open.set()
    assert res["success"] and res["num_paused_requests"] == 1, res
    assert long_out["meta_info"]["finish_reason"]["type"] == "length"
    assert long_out["output_ids"] == reference["a"][1]  # all 40 tokens on the old weights
    assert _tokens_and_logprobs([new_out]) == reference["b"][0][:1]  # on the new weights
    _idle(eng)


def test_held_request_can_leave(eng_sync, ckpts):
    """A client leaving while its request is held for a swap aborts it there: it is never
    queued, and the update counts no paused request."""
    eng = eng_sync
    _use(eng, ckpts["a"])
    gate = Gate()
    eng.fault_injector = gate

    async def scenario():
        long_task, _, update = await _update_pending_mid_stream(eng, gate, ckpts["b"])
        held = asyncio.ensure_future(_final(eng, _req(PROMPTS[1], GREEDY)))
        await _until(lambda: eng.pool_stats()["num_queued"] == 1, "the new request to be held")
        held.cancel()  # the consumer leaves
        await _until(lambda: eng.pool_stats()["num_queued"] == 0, "the held request to go")
        gate.open.set()
        await asyncio.wait_for(long_task, TIMEOUT_S)
        return await asyncio.wait_for(update, TIMEOUT_S)

    try:
        res = asyncio.run(scenario())
    finally:
        eng.fault_injector = None
        gate.open.set()
    assert res["success"] and res["num_paused_requests"] == 0, res
    _idle(eng)


def test_abort_all_requests(eng, ckpts, reference):
    _use(eng, ckpts["a"])
    gate = Gate()
    eng.fault_injector = gate

    async def scenario():
        outs: list[list] = [[], []]
        tasks = [asyncio.ensure_future(_first_token_then(eng, _req(p, LONG, stream=True), o))
                 for p, o in zip(PROMPTS, outs)]
        await _until(lambda: all(outs), "both requests' first tokens")
        gate.close()
        await _until(gate.parked.is_set, "the loop to park")
        update = asyncio.ensure_future(asyncio.to_thread(
            eng.update_weights_from_disk, str(ckpts["b"]), abort_all_requests=True))
        await _until(lambda: eng.weights.pending is not None, "the update to be pending")
        gate.open.set()
        res = await asyncio.wait_for(update, TIMEOUT_S)
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        return res, [o[-1] for o in outs]

    try:
        res, finals = asyncio.run(scenario())
    finally:
        eng.fault_injector = None
        gate.open.set()
    assert res["success"], res
    for out in finals:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "weight update" in reason["message"], reason
        assert len(out["output_ids"]) < LONG["max_new_tokens"]
    s = _idle(eng)
    assert (s["kv_pages_cached"], s["gdn_snapshots_used"]) == (0, 0), s
    assert _tokens_and_logprobs(_run_each(eng)) == reference["b"][0]


@pytest.mark.parametrize("engine_fixture", ["eng", "eng_sync"])
def test_update_deadline_aborts_stragglers_and_held_requests_are_bounded(request, engine_fixture,
                                                                          ckpts, reference):
    """Requests still running ``--weight-update-timeout`` s after the update was asked for
    are aborted with a message naming the flag, and the swap goes ahead; meanwhile at most
    ``--max-queued-requests`` new requests are held, more get ServiceUnavailableError."""
    import dataclasses

    from sglang_tpu_backend.managers.io_struct import ServiceUnavailableError

    eng = request.getfixturevalue(engine_fixture)
    _use(eng, ckpts["a"])
    args = eng.weights.args
    eng.weights.args = dataclasses.replace(args, weight_update_timeout=0.3, max_queued_requests=1)
    gate = Gate()
    eng.fault_injector = gate

    async def scenario():
        long_task, long_outs, update = await _update_pending_mid_stream(eng, gate, ckpts["b"])
        held = asyncio.ensure_future(_final(eng, _req(PROMPTS[1], GREEDY)))
        await _until(lambda: eng.pool_stats()["num_queued"] == 1, "the new request to be held")
        with pytest.raises(ServiceUnavailableError, match="held for a weight update"):
            await _final(eng, _req(PROMPTS[0], GREEDY))
        await asyncio.sleep(0.4)  # past the deadline, with the long request still running
        gate.open.set()
        res = await asyncio.wait_for(update, TIMEOUT_S)
        await asyncio.wait_for(long_task, TIMEOUT_S)
        return res, long_outs[-1], await asyncio.wait_for(held, TIMEOUT_S)

    try:
        res, long_out, held_out = asyncio.run(scenario())
    finally:
        eng.fault_injector = None
        eng.weights.args = args
        gate.open.set()
    assert res["success"] and res["num_paused_requests"] == 1, res
    reason = long_out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "--weight-update-timeout" in reason["message"], reason
    assert len(long_out["output_ids"]) < LONG["max_new_tokens"]
    assert held_out["meta_info"]["finish_reason"]["type"] == "length"
    assert eng.get_model_info()["weight_version"] != "default"
    _idle(eng)


@pytest.mark.parametrize("name, problem, field", [
    ("wider", "hidden_size", None),
    ("missing", "lacks 1 tensor(s): model.language_model.norm.weight", None),
    ("shorter", "model.language_model.norm.weight expected shape [128], got [127]", None),
    ("nowhere", "is not a directory", None),
    ("a", "load_format 'gguf' is not supported", "gguf"),
])
def test_mismatched_checkpoint_is_refused(eng, ckpts, reference, tmp_path, name, problem, field):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app

    _use(eng, ckpts["a"])
    version = eng.get_model_info()["weight_version"]
    path = str(ckpts.get(name, tmp_path / name))
    body = {"model_path": path, **({"load_format": field} if field else {})}
    r = TestClient(create_app(eng)).post("/update_weights_from_disk", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and problem in r.json()["message"], r.json()
    assert eng.get_model_info()["weight_version"] == version
    assert _tokens_and_logprobs(_run_each(eng)) == reference["a"][0]  # the old weights serve
    _idle(eng)


def test_bad_fields_answer_400_naming_them(eng):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app

    client = TestClient(create_app(eng))
    for body, param in [({}, "model_path"), ({"model_path": 3}, "model_path"),
                        ({"model_path": "x", "abort_all_requests": "yes"}, "abort_all_requests"),
                        ({"model_path": "x", "weight_version": 7}, "weight_version")]:
        r = client.post("/update_weights_from_disk", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_without_loop_thread_swaps_only_when_idle(ckpts):
    """An engine its caller steps (``start_loop=False``): an update waiting for a queued
    request would never be done, so it is refused and the request stays queued; aborting it
    lets the swap happen at once."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS), start_loop=False)
    try:
        req = e.add_request(_req(PROMPTS[0], GREEDY))
        res = e.update_weights_from_disk(str(ckpts["b"]))
        assert not res["success"] and "no scheduler loop" in res["message"], res
        assert e.get_model_info()["weight_version"] == "default"
        assert e.pool_stats()["num_queued"] == 1 and e.weights.pending is None
        res = e.update_weights_from_disk(str(ckpts["b"]), abort_all_requests=True)
        assert res["success"] and e.get_model_info()["weight_version"] == "1", res
        assert req.finish_reason["type"] == "abort"
        assert e.step() is None and e.pool_stats()["num_queued"] == 0
    finally:
        e.shutdown()


def test_next_weight_version():
    from sglang_tpu_backend.model_executor.weight_update import next_weight_version

    assert [next_weight_version(v, None) for v in ("default", "3", "step-9")] == ["1", "4", "step-10"]
    assert next_weight_version("3", "rollout-a") == "rollout-a"
