"""The accelerator load path's read-ahead: bounded, in order, errors surfaced, threads stopped."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from sglang_tpu_backend.model_loader import load_programs, read_ahead, sharded_loader
from sglang_tpu_backend.model_loader.checkpoint_io import (
    index_checkpoint, quantize_checkpoint_fp8, write_checkpoint)
from sglang_tpu_backend.model_loader.loader import CheckpointError, load_model
from sglang_tpu_backend.models.param_shapes import param_shapes
from tests.cpu_devices import run_on_cpu_devices
from tests.model.test_loader import assert_trees_equal, nested_config, tensors_for


def _single_device(cfg, keep_fp8: bool):
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: where, param_shapes(cfg, jnp.float32, fp8_experts=keep_fp8))


_compiles: list[str] = []  # the thread of every backend compile since the listener was added


def _on_duration(event: str, duration: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles.append(threading.current_thread().name)


jax.monitoring.register_event_duration_secs_listener(_on_duration)  # (cannot be removed)


def _load_compiling_where(load) -> tuple[list[str], set]:
    """Run ``load()`` on cleared compile caches: the threads its backend compiles ran on, and
    the keys of the programs the loader's ``Precompiler`` was given."""
    jax.clear_caches()
    load_programs.writer.cache_clear()
    load_programs._zeros_fn.cache_clear()
    keys, submit = set(), load_programs.Precompiler.submit

    def record(self, key, lower):
        keys.add(key)
        return submit(self, key, lower)

    load_programs.Precompiler.submit = record
    first = len(_compiles)
    try:
        load()
    finally:
        load_programs.Precompiler.submit = submit
    return _compiles[first:], keys


def _new_threads(before: set) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_read_ahead_keeps_order_and_its_byte_bound():
    """Jobs start in order, at most max_bytes of them pending (one alone when larger), results
    come back in order, and take() waits for a slow one."""
    lock, started, asked = threading.Lock(), [], [0]

    def job(k: int, delay: float):
        def read():
            with lock:
                started.append(k)
                # at most started - asked pending: 10-byte jobs under a 25-byte bound
                assert len(started) - asked[0] <= (1 if k == 3 else 2), (started, asked)
            time.sleep(delay)
            return k
        return read

    sizes = [10, 10, 10, 100, 10, 10]
    jobs = [(n, job(k, 0.05 if k == 4 else 0.0)) for k, n in enumerate(sizes)]
    with read_ahead.ReadAhead(jobs, workers=3, max_bytes=25) as ahead:
        out = []
        for _ in sizes:
            with lock:
                asked[0] += 1
            out.append(ahead.take())
        with pytest.raises(StopIteration):
            ahead.take()
    assert out == list(range(6)) and started == list(range(6))
    assert ahead.wait_seconds > 0.02 and ahead.reader_seconds >= 0.05


def test_read_ahead_error_surfaces_and_stops_the_threads():
    before = set(threading.enumerate())
    release = threading.Event()

    def bad():
        raise CheckpointError("tensor x: read failed (boom)")

    jobs = [(1, lambda: 0), (1, bad), (1, release.wait), (1, lambda: 3)]
    with pytest.raises(CheckpointError, match="boom"):
        with read_ahead.ReadAhead(jobs, workers=2, max_bytes=10) as ahead:
            assert ahead.take() == 0
            threading.Timer(0.1, release.set).start()  # close() waits for the running job
            ahead.take()
    time.sleep(0.2)  # the timer thread ends
    assert not _new_threads(before)


@pytest.mark.parametrize("keep_fp8", [False, True], ids=["dequantised", "fp8-kept"])
def test_device_path_with_a_blocking_read_ahead_equals_the_whole_load(tmp_path, monkeypatch,
                                                                      keep_fp8):
    """host_buffers=False on a CPU device, the read-ahead bounded below one leaf (so every
    leaf is read alone and the main thread waits for it): the whole load's params, every
    byte read once."""
    monkeypatch.setattr(read_ahead, "AHEAD_BYTES", 1)
    waits, pending = [], []
    take, run = read_ahead.ReadAhead.take, read_ahead.ReadAhead._run

    def counted(self):
        waits.append(self._pending[0][1].done() if self._pending else None)
        return take(self)

    def slow(self, read):
        pending.append(len(self._pending))
        time.sleep(0.02)  # slower than placing most leaves of this model: take() waits
        return run(self, read)

    monkeypatch.setattr(read_ahead.ReadAhead, "take", counted)
    monkeypatch.setattr(read_ahead.ReadAhead, "_run", slow)
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=5)),
                            config, shards=3)
    cfg, whole = load_model(path, dtype=jnp.float32, keep_fp8_experts=keep_fp8, backend="tpu")
    before = set(threading.enumerate())
    params, report = sharded_loader.load_sharded(
        path, cfg, _single_device(cfg, keep_fp8), dtype=jnp.float32, keep_fp8_experts=keep_fp8,
        backend="tpu", host_buffers=False, progress=False)
    assert_trees_equal(params, whole)
    assert not _new_threads(before)
    assert waits.count(False) >= len(waits) // 4  # the main thread waited for many leaves
    assert max(pending) <= 1  # each read alone: the bound held every next one back
    entries = index_checkpoint(path).values()
    assert report.bytes_read == sum(e.end - e.begin for e in entries)
    experts = sum(e.end - e.begin for e in entries if ".mlp.experts." in e.name)
    assert report.expert_bytes == {jax.devices()[0].id: experts}
    assert 0 < report.read_seconds <= report.seconds and report.reader_seconds > 0


def test_device_path_compiles_each_program_once_on_the_compile_threads(tmp_path):
    """Every zeroing and write program of the device path is compiled ahead on the
    Precompiler's threads, once: the loading thread's calls find them compiled (their
    abstract lowering has the real call's cache key)."""
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=8)),
                            config, shards=2)
    cfg, whole = load_model(path, dtype=jnp.float32, keep_fp8_experts=True, backend="tpu")
    got = {}

    def load():
        got["params"], _ = sharded_loader.load_sharded(
            path, cfg, _single_device(cfg, True), dtype=jnp.float32, keep_fp8_experts=True,
            backend="tpu", host_buffers=False, progress=False)

    threads, keys = _load_compiling_where(load)
    assert_trees_equal(got["params"], whole)
    assert len(keys) > 10 and len(threads) == len(keys), (len(threads), len(keys))
    assert all(t.startswith("load-compile") for t in threads), threads


def test_device_path_read_error_propagates_and_stops_every_thread(tmp_path, monkeypatch):
    """A read failing on a reader thread midway (the half-way positional read) is raised by
    load_sharded as the CheckpointError it was, and no reading thread is left."""
    config = nested_config()
    path = write_checkpoint(tmp_path / "ckpt", tensors_for(config, seed=6), config, shards=2)
    cfg = load_model(path, dtype=jnp.float32)[0]
    shardings = _single_device(cfg, False)
    real, calls = os.preadv, [0]

    def counting(fd, buffers, offset):
        calls[0] += 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    sharded_loader.load_sharded(path, cfg, shardings, dtype=jnp.float32, host_buffers=False)
    fail_at, calls[0] = calls[0] // 2, 0

    def failing(fd, buffers, offset):
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError("injected I/O error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    before = set(threading.enumerate())
    with pytest.raises(CheckpointError, match="read failed .injected I/O error"):
        sharded_loader.load_sharded(path, cfg, shardings, dtype=jnp.float32, host_buffers=False,
                                    progress=False)
    assert not _new_threads(before)


def test_device_path_over_expert_parallel_devices(tmp_path):
    """On 4 CPU devices with the routed experts split over them (bench_load's DP x EP
    shardings), the device path with a blocking read-ahead gives the host path's params and
    reads each device's experts for it once."""
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=7)),
                            config, shards=2)
    out = tmp_path / "out.json"
    run_on_cpu_devices(Path(__file__), "--ep", str(path), str(out), num_devices=4)
    r = json.loads(out.read_text())
    assert len(r["compile_threads"]) == r["programs"] > 10  # each once, ahead, on its threads
    assert all(t.startswith("load-compile") for t in r["compile_threads"])
    assert r["equal"] and r["expert_ranges"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert r["device_bytes"] == r["host_bytes"] == r["total"]
    assert r["expert_bytes"] == [r["experts"] // 4] * 4


def _ep_child(path: str, out: str) -> None:
    from sglang_tpu_backend.config import load_model_config
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import make_mesh

    read_ahead.AHEAD_BYTES = 1
    cfg = load_model_config(path)
    shardings = DPForward(cfg, make_mesh(4)).param_shardings(
        param_shapes(cfg, jnp.float32, fp8_experts=True))
    kw = dict(dtype=jnp.float32, keep_fp8_experts=True, backend="tpu", progress=False)
    got = {}

    def load():
        got["a"] = sharded_loader.load_sharded(path, cfg, shardings, host_buffers=False, **kw)

    threads, keys = _load_compiling_where(load)
    a, ra = got["a"]
    b, rb = sharded_loader.load_sharded(path, cfg, shardings, host_buffers=True, **kw)
    try:
        assert_trees_equal(a, b)
        equal = True
    except AssertionError:
        equal = False
    entries = index_checkpoint(path).values()
    Path(out).write_text(json.dumps({
        "equal": equal, "compile_threads": threads, "programs": len(keys),
        "expert_ranges": sorted(ra.expert_ranges.values()),
        "expert_bytes": [ra.expert_bytes[d.id] for d in jax.devices()],
        "device_bytes": ra.bytes_read, "host_bytes": rb.bytes_read,
        "total": sum(e.end - e.begin for e in entries),
        "experts": sum(e.end - e.begin for e in entries if ".mlp.experts." in e.name)}))


if __name__ == "__main__" and sys.argv[1] == "--ep":
    _ep_child(sys.argv[2], sys.argv[3])
