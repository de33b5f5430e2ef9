"""SGLang's RL surface: ``update_weights_from_tensor`` (engine and ``POST
/update_weights_from_tensor``), ``release`` / ``resume_memory_occupation``, ``pause`` /
``continue_generation`` and the offline Engine's other SGLang calls.

Checkpoint "B" is the tiny model's config with weights from seed 1
(``tiny_model.write_random_model``); one engine (f32, CPU) serves every test here.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import jax
import numpy as np
import pytest

from tests.engine.conftest import ENGINE_ARGS
from tests.engine.engine_runs import GREEDY, LONG, PROMPTS, TIMEOUT_S
from tests.engine.engine_runs import req as _req
from tests.engine.engine_runs import run_each as _run_each
from tests.engine.engine_runs import tokens_and_logprobs as _tokens_and_logprobs

EMBED = "model.language_model.embed_tokens.weight"






def _assert_close(got, want, tol=1e-5):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    from sglang_tpu_backend.model_loader.tiny_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("weights") / "b", seed=1)


@pytest.fixture(scope="module")
def eng():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def ref_a(eng):
    """PROMPTS on the tiny model's own weights (before any update here)."""
    eng.flush_cache()
    return _tokens_and_logprobs(_run_each(eng))


@pytest.fixture(scope="module")
def ref_b(ckpt_b):
    """PROMPTS on an engine started on B."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    e = Engine(ServerArgs(**ENGINE_ARGS, model_path=str(ckpt_b)))
    try:
        return _tokens_and_logprobs(_run_each(e))
    finally:
        e.shutdown()


def _fresh(engine):
    engine.flush_cache()  # prefill from scratch, as the references did
    return _tokens_and_logprobs(_run_each(engine))


def test_update_from_tensor_matches_engine_on_b(eng, ckpt_b, ref_a, ref_b):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.entrypoints.rl_routes import encode_named_tensors
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    assert ref_a != ref_b
    tensors_a, tensors_b = read_checkpoint(default_model_path()), read_checkpoint(ckpt_b)
    # The embedding as a jax.Array already placed as the serving one: taken without a copy.
    embed = jax.device_put(tensors_b[EMBED].astype(np.float32),
                           eng.runner.params["embed_tokens"].sharding)
    named = [(n, embed if n == EMBED else t) for n, t in tensors_b.items()]
    counter = CompileCounter()
    res = eng.update_weights_from_tensor(named, weight_version="b")
    assert res["success"], res
    assert eng.runner.params["embed_tokens"] is embed
    _assert_close(_fresh(eng), ref_b)
    assert counter.lowerings == 0 and counter.backend_compiles == 0, "the update recompiled"
    assert _run_each(eng)[0]["meta_info"]["weight_version"] == eng.get_weight_version() == "b"

    # Refused updates name the tensor and leave B serving.
    norm = "model.language_model.norm.weight"
    for bad, named_in_error in [({"model.language_model.layers.0.nope.weight": tensors_b[norm]},
                                 "layers.0.nope.weight"),
                                ({norm: tensors_b[norm][:-1], EMBED: tensors_a[EMBED]}, norm)]:
        res = eng.update_weights_from_tensor(bad)
        assert not res["success"] and named_in_error in res["message"], res
    assert eng.get_weight_version() == "b"
    _assert_close(_fresh(eng), ref_b, tol=0)

    # HTTP: A in one call, then B in two (the first keeps the prefix cache).
    client = TestClient(create_app(eng))
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": encode_named_tensors(tensors_a), "weight_version": "a"})
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_close(_fresh(eng), ref_a)
    names = sorted(tensors_b)
    for half, flush in ((names[::2], False), (names[1::2], True)):
        r = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [encode_named_tensors({n: tensors_b[n] for n in half})],
            "flush_cache": flush})
        assert r.status_code == 200 and r.json()["success"], r.text
    _assert_close(_fresh(eng), ref_b)
    assert eng.get_weight_version() == "2"  # "a" has no number: "1", then "2"


def test_update_from_distributed_matches_engine_on_b(eng, ckpt_b, ref_a, ref_b):
    """A trainer's ``WeightSender`` offers checkpoint A, then B (device to device,
    ``jax.experimental.transfer``); the engine pulls each by names, dtypes and shapes (the
    Python call, then HTTP) and serves exactly what an engine started on it serves; a refit
    with an unknown name is refused naming it and leaves the weights serving."""
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.managers.weight_group import WeightSender
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    tensors_a, tensors_b = read_checkpoint(default_model_path()), read_checkpoint(ckpt_b)
    sender = WeightSender(world_size=2)
    host, port = sender.address
    assert eng.init_weights_update_group(host, port, 1, 2)["success"]
    assert not eng.init_weights_update_group(host, port, 1, 2)["success"]  # the name exists
    refused = eng.init_weights_update_group(host, port, 1, 2, group_name="g2", backend="nccl")
    assert not refused["success"] and "backend 'nccl'" in refused["message"]

    res = eng.update_weights_from_distributed(**sender.send(list(tensors_a.items())),
                                              weight_version="dist-a")
    assert res["success"] and res["transfer_gb_per_s"] > 0, res
    assert res["transfer_gb"] == pytest.approx(sum(t.nbytes for t in tensors_a.values()) / 1e9)
    _assert_close(_fresh(eng), ref_a)

    client = TestClient(create_app(eng))
    body = {**sender.send(list(tensors_b.items())), "weight_version": "dist-b"}
    r = client.post("/update_weights_from_distributed", json=body)
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_close(_fresh(eng), ref_b)
    assert eng.get_weight_version() == "dist-b"

    bad = "model.language_model.layers.0.nope.weight"
    res = eng.update_weights_from_distributed(**sender.send([(bad, np.ones(4, np.float32))]))
    assert not res["success"] and "layers.0.nope.weight" in res["message"], res
    _assert_close(_fresh(eng), ref_b, tol=0)
    r = client.post("/update_weights_from_distributed", json={"names": ["x"], "dtypes": []})
    assert r.status_code == 400 and "shapes" in r.text
    assert client.post("/destroy_weights_update_group", json={}).json()["success"]
    res = eng.update_weights_from_distributed(["x"], ["float32"], [[1]])
    assert not res["success"] and "no such group" in res["message"]


def test_http_update_from_tensor_bad_payloads(eng):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.entrypoints.rl_routes import encode_named_tensors

    client = TestClient(create_app(eng))
    version = eng.get_weight_version()
    ok = encode_named_tensors({"model.language_model.norm.weight": np.ones(3, np.float32)})
    for body, param in [({}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": "not base64!"}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": "AAAA"}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": [ok, ok]}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": ok, "load_format": "torch"}, "load_format"),
                        ({"serialized_named_tensors": ok, "flush_cache": "yes"}, "flush_cache")]:
        r = client.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ok})
    assert r.status_code == 400 and "norm.weight is [3]" in r.json()["message"], r.text
    assert eng.get_weight_version() == version


def test_fp8_and_per_expert_tensors_build_what_the_loader_reads(ckpt_b, tmp_path):
    """FP8 block-scaled, per-expert tensors (a subset first, then the rest) give the params
    the loader reads from a checkpoint of those tensors."""
    import json

    import jax.numpy as jnp

    from sglang_tpu_backend.model_loader.checkpoint_io import (
        quantize_checkpoint_fp8, read_checkpoint, write_checkpoint)
    from sglang_tpu_backend.model_loader.loader import load_model
    from sglang_tpu_backend.model_executor.tensor_update import build_params
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    cfg, serving = load_model(default_model_path(), dtype=jnp.float32)
    serving = jax.device_put(serving, jax.devices()[0])
    fp8 = quantize_checkpoint_fp8(read_checkpoint(ckpt_b))
    write_checkpoint(tmp_path / "fp8", fp8, json.loads((ckpt_b / "config.json").read_text()))
    _, want = load_model(tmp_path / "fp8", dtype=jnp.float32)
    first = {n: t for n, t in fp8.items() if ".experts.3." in n}
    half, _, report = build_params(first, cfg, serving, dtype=np.float32)
    assert report["num_leaves"] == cfg.layer_period * 2  # gate_up, down of each layer group
    assert report["num_read_back"] == report["num_leaves"]  # one expert of E: merged
    full, _, _ = build_params({n: t for n, t in fp8.items() if n not in first}, cfg, half,
                           dtype=np.float32)
    once, _, report = build_params(fp8, cfg, serving, dtype=np.float32)
    assert report["num_read_back"] == 0  # every leaf whole: nothing read from the devices
    for got, again, ref in zip(jax.tree.leaves(full), jax.tree.leaves(once), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        np.testing.assert_array_equal(np.asarray(again), np.asarray(ref))


def _device_bytes(runner) -> int:
    """Bytes of every device array the runner holds (params, KV / GDN state, snapshots,
    sampler state)."""
    trees = [runner.params, runner.cache, runner.sampler.counts, runner.sampler.prompt_mask,
             runner.sampler.last_tokens]
    if runner.snapshots is not None:
        trees += [runner.snapshots.conv, runner.snapshots.rec]
    return sum(a.nbytes for a in jax.tree.leaves(trees))


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_release_and_resume_memory(eng, capsys):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.entrypoints.http_server import create_app
    from sglang_tpu_backend.managers.io_struct import ServiceUnavailableError
    from sglang_tpu_backend.managers.rl_control import RLStateError
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    before = _fresh(eng)
    busy = eng.add_request(_req(PROMPTS[0], LONG))  # no consumer: it runs until aborted
    with pytest.raises(RLStateError, match="request"):
        eng.release_memory_occupation()
    assert eng.abort_request(busy.rid)

    owned0, live0 = _device_bytes(eng.runner), _live_bytes()
    client = TestClient(create_app(eng))
    r = client.post("/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and r.json()["tags"] == ["kv_cache", "weights"], r.text
    owned1 = sum(a.nbytes for a in jax.tree.leaves([eng.runner.sampler.last_tokens]))
    live1 = _live_bytes()
    with capsys.disabled():
        print(f"\nrelease: engine device bytes {owned0} -> {owned1}; "
              f"live device bytes {live0} -> {live1} (freed {r.json()['freed_bytes']})")
    assert eng.runner.params is None and eng.runner.cache is None
    assert owned1 <= 0.2 * owned0 and live0 - live1 >= 0.8 * owned0
    with pytest.raises(ServiceUnavailableError, match="resume_memory_occupation"):
        _run_each(eng)
    with pytest.raises(RLStateError, match="weights are released"):
        eng.update_weights_from_disk("/nonexistent")
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and "released" in r.text
    assert client.get("/get_server_info").json()["memory_released"] == ["kv_cache", "weights"]
    assert client.get("/metrics").status_code == 200 and client.get("/health").status_code == 200

    counter = CompileCounter()
    assert eng.resume_memory_occupation(["weights"])["tags"] == ["kv_cache"]
    # verl's order: weights back, refit them, then the KV cache (the same values here).
    norm = np.asarray(eng.runner.params["norm"])
    res = eng.update_weights_from_tensor({"model.language_model.norm.weight": norm})
    assert res["success"], res
    r = client.post("/resume_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["tags"] == [], r.text
    after = _fresh(eng)
    assert after == before  # bit for bit: the same weights through the same programs
    assert counter.lowerings == 0 and counter.backend_compiles == 0, "waking recompiled"
    assert _device_bytes(eng.runner) == owned0

    # One tag at a time: the KV state alone, the weights stay.
    assert eng.release_memory_occupation(["kv_cache"])["tags"] == ["kv_cache"]
    assert eng.runner.params is not None and eng.runner.cache is None
    eng.resume_memory_occupation(["kv_cache"])
    assert _fresh(eng) == before and counter.lowerings == 0


@contextlib.contextmanager
def _slow_steps(engine, seconds=0.02):
    """Each step takes at least ``seconds`` (so a stream is still running when paused)."""
    engine.fault_injector = lambda phase: time.sleep(seconds) if phase == "schedule" else None
    try:
        yield
    finally:
        engine.fault_injector = None


def _stream(engine, text, sp, outs: list):
    """A task collecting ``text``'s outputs into ``outs``; returns the last one."""
    async def consume():
        async for o in engine.generate_request(_req(text, sp, stream=True)):
            outs.append(o)
        return outs[-1]
    return asyncio.ensure_future(consume())


async def _until(pred, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _assert_still(engine, outs, seconds=0.4):
    """No output and no step while paused."""
    await asyncio.sleep(0.05)  # outputs delivered before the pause reach the consumer
    n, steps = len(outs), engine.stats["num_steps"]
    await asyncio.sleep(seconds)
    assert len(outs) == n and engine.stats["num_steps"] == steps


def test_pause_retract_midstream_completes_as_uninterrupted(eng):
    eng.flush_cache()
    want = _run_each(eng, PROMPTS[:1], LONG)[0]["output_ids"]
    eng.flush_cache()

    async def run():
        outs: list = []
        task = _stream(eng, PROMPTS[0], LONG, outs)
        await _until(lambda: len(outs) >= 5)
        res = await asyncio.to_thread(eng.pause_generation, "retract")
        assert res["num_retracted"] == 1 and not eng.scheduler.running
        assert eng.scheduler.num_waiting == 1
        await _assert_still(eng, outs)
        got_so_far = len(outs[-1]["output_ids"])
        eng.continue_generation()
        last = await asyncio.wait_for(task, TIMEOUT_S)
        return got_so_far, last

    with _slow_steps(eng):
        got_so_far, last = asyncio.run(run())
    assert 5 <= got_so_far < len(want)
    assert last["output_ids"] == want and last["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_and_abort(eng, ckpt_b):
    from fastapi.testclient import TestClient

    from sglang_tpu_backend.model_loader.checkpoint_io import read_checkpoint
    from sglang_tpu_backend.entrypoints.http_server import create_app

    client = TestClient(create_app(eng))
    norm = "model.language_model.norm.weight"
    norm_b = read_checkpoint(ckpt_b)[norm]

    async def run():
        outs: list = []
        task = _stream(eng, PROMPTS[1], LONG, outs)
        await _until(lambda: len(outs) >= 3)
        r = await asyncio.to_thread(client.post, "/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200 and r.json()["mode"] == "in_place", r.text
        assert len(eng.scheduler.running) == 1  # kept its pages and slot
        assert eng.get_server_info()["paused"] == "in_place"
        await _assert_still(eng, outs)
        # A weight update does not wait for the paused request.
        res = await asyncio.to_thread(eng.update_weights_from_tensor, {norm: norm_b},
                                      weight_version="paused-update")
        assert res["success"], res
        r = await asyncio.to_thread(client.post, "/continue_generation")
        assert r.status_code == 200
        last = await asyncio.wait_for(task, TIMEOUT_S)
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["weight_version"] == "paused-update"

        outs = []
        task = _stream(eng, PROMPTS[0], LONG, outs)
        await _until(lambda: len(outs) >= 2)
        res = await asyncio.to_thread(eng.pause_generation, "abort")
        assert res["num_aborted"] == 1
        last = await asyncio.wait_for(task, TIMEOUT_S)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        queued: list = []  # arrives while paused: waits, then runs
        task = _stream(eng, PROMPTS[1], GREEDY, queued)
        await _assert_still(eng, queued)
        assert not queued and eng.scheduler.num_waiting == 1
        eng.continue_generation()
        last = await asyncio.wait_for(task, TIMEOUT_S)
        assert last["meta_info"]["finish_reason"]["type"] == "length"

    with _slow_steps(eng):
        asyncio.run(run())
    r = client.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def test_offline_engine_calls(eng, tmp_path):
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine

    off = OfflineEngine(engine=eng)
    try:
        assert off.flush_cache() is True
        info = off.get_server_info()
        assert "pool_stats" in info and info["weight_version"] == off.get_weight_version()
        assert off.abort_request("no-such-rid") is False
        busy = eng.add_request(_req(PROMPTS[0], LONG))
        assert off.abort_request(abort_all=True) is True and busy.finished
        off.start_expert_distribution_record()
        off.generate(PROMPTS[1], GREEDY)
        off.stop_expert_distribution_record()
        assert (tmp_path / "x").exists() is False
        path = off.dump_expert_distribution_record(str(tmp_path / "x"))
        assert path.startswith(str(tmp_path / "x"))
        ok, message, _ = off.update_weights_from_disk(str(tmp_path / "missing"))  # SGLang's tuple
        assert not ok and "missing" in message
        version = off.get_weight_version()
        norm = "model.language_model.norm.weight"
        ok, message = off.update_weights_from_tensor([(norm, np.ones(3, np.float32))])
        assert not ok and norm in message and off.get_weight_version() == version
        assert off.pause_generation("in_place")["success"] and off.continue_generation()["success"]
        assert off.release_memory_occupation(["kv_cache"])["tags"] == ["kv_cache"]
        assert off.resume_memory_occupation()["tags"] == []
        assert off.generate(PROMPTS[1], GREEDY)["meta_info"]["weight_version"] == off.get_weight_version()
    finally:
        off.close()


def test_refit_and_sleep_with_dp_ranks_and_split_experts(tmp_path):
    """--dp-size 2 --ep-size 2 (``rl_dp_run.py`` in a subprocess with 4 CPU devices): B's
    tensors in two calls give an engine started on B's tokens, with the experts split over
    the devices and every leaf's sharding kept; release frees the params and KV pages;
    nothing recompiles. The same with EPLB (24 slots over the 2 EP ranks) after a forced
    rebalance. --tp-size 4 with NEXTN: the same refit gives a TP4 NEXTN engine
    started on B's tokens and MTP params, shardings kept; release / resume keep the outputs."""
    import json
    from pathlib import Path

    from tests.cpu_devices import run_on_cpu_devices

    out = tmp_path / "out.json"
    run_on_cpu_devices(Path(__file__).resolve().parent / "rl_dp_run.py", str(out),
                       str(tmp_path / "b"), num_devices=4)
    r = json.loads(out.read_text())
    assert r["a"] != r["b"] and r["refit"] == r["b"] and r["resumed"] == r["b"]
    assert r["experts_split"] and r["freed_bytes"] >= r["device_bytes"]
    assert r["lowerings"] == 0 and r["same_shardings"]
    assert r["tp"] != r["tp_b"], r
    assert r["tp_refit"] == r["tp_b"] and r["tp_resumed"] == r["tp_b"] and r["tp_same_shardings"]
    assert r["tp_mtp_equal"]
    assert r["eplb_moved"] and r["eplb_refit"] == r["b"] and r["eplb_same_shardings"]
