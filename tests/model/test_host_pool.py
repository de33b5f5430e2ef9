"""The accelerator load path's recycled host buffers (``host_pool.py``) and its leaves in
flight: buffers reused, never while a write may still read them, and the pool's cap held."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.model_loader import host_load, host_pool, load_programs, sharded_loader
from sglang_tpu_backend.model_loader.checkpoint_io import quantize_checkpoint_fp8, write_checkpoint
from sglang_tpu_backend.model_loader.loader import CheckpointLeaves, load_model
from sglang_tpu_backend.models.param_shapes import param_shapes
from tests.model.test_loader import assert_trees_equal, nested_config, tensors_for
from tests.model.test_read_ahead import _new_threads, _single_device


def test_pool_reuses_by_shape_and_dtype_and_holds_its_cap():
    """A returned buffer serves the next get of its shape and dtype (not another's); what the
    pool holds (handed out + kept) stays under the cap, the oldest kept buffers let go first;
    arrays it did not hand out are ignored."""
    pool = host_pool.HostPool(cap_bytes=3 * 4096)
    a = pool.get((1024,), np.float32)  # 4096 bytes each
    pool.put(a)
    assert pool.get((1024,), np.float32) is a and pool.recycled == 1
    b = pool.get((1024,), np.int32)
    assert b is not a and pool.fresh == 2  # same bytes, another dtype: not a's
    pool.put(a)
    pool.put(b)
    c = pool.get((2048,), np.float32)  # 8192 bytes: a, the oldest kept, goes
    assert pool.evicted == 1 and pool.held_bytes == 3 * 4096
    assert pool.get((1024,), np.int32) is b
    pool.put(np.empty((1024,), np.float32))  # not the pool's: ignored
    assert pool.held_bytes == 3 * 4096 and pool.counts() == {
        "recycled": 2, "fresh": 3, "evicted": 1}
    d = pool.get((1024,), np.float32)  # handed out alone past the cap: allocated anyway
    assert d is not a and pool.held_bytes == 4 * 4096
    pool.put(d)  # and let go on its return, as nothing may be kept past the cap
    assert pool.held_bytes == 3 * 4096 and pool.evicted == 2
    pool.drop(c)
    pool.put(c)  # dropped: never taken back
    assert pool.held_bytes == 4096


def test_retire_waits_for_the_write_and_drops_host_arrays_a_cpu_device_kept():
    """``retire``: a leaf consumed by a write (still there) comes back once written; a leaf
    that is the param itself and whose CPU device array aliases the host array is dropped."""
    pool = host_pool.HostPool(cap_bytes=1 << 20)
    buf = pool.get((8, 16), np.float32)
    buf[...] = 1.0
    x = jax.device_put(buf, jax.devices()[0])
    assert host_load.aliases(x, [buf])  # CPU devices take page-aligned host arrays as is
    out = jnp.zeros((2, 8, 16)).at[0].set(x)
    host_pool.retire(out, x, [buf], pool)
    assert pool.get((8, 16), np.float32) is buf  # back, and handed out again
    host_pool.retire(x, x, [buf], pool)  # x is the param: buf is its memory
    assert pool.get((8, 16), np.float32) is not buf and pool.evicted == 0


def _slow_slot_writes(monkeypatch, n: int) -> None:
    """Make every slot write run an ``[n, n]`` matmul on the devices before it reads its leaf
    (its input waits for it), so the main thread runs ahead of the writes: a host buffer
    handed back before its write ran is overwritten before the write reads it. (A host
    callback would not do: programs with one dispatch synchronously on CPU.)"""
    real = load_programs._write_slot

    def slow(buf, x, g, swapped: bool):
        m = jnp.full((n, n), g.astype(jnp.float32))
        busy = (jnp.sum(jnp.sin(m @ m)) * 0).astype(jnp.int32)  # 0, not folded away
        g, x = jax.lax.optimization_barrier((g + busy, x))
        return real(buf, x, g, swapped)

    monkeypatch.setattr(load_programs, "_write_slot", slow)
    load_programs.writer.cache_clear()


@pytest.mark.parametrize("keep_fp8", [False, True], ids=["dequantised", "fp8-kept"])
def test_device_path_recycles_buffers_only_once_written(tmp_path, monkeypatch, keep_fp8):
    """host_buffers=False on a CPU device (whose arrays alias the host buffers they were
    placed from), slot writes slowed down: every buffer handed back to the pool is at once
    overwritten with garbage, yet the params equal the whole load; buffers were recycled,
    none kept past the pool's cap, and no thread is left."""
    put, seen = host_pool.HostPool.put, {"puts": 0, "cap": 0, "over": []}

    def corrupting(self, buf):
        if self._out.get(id(buf), (None,))[0] is buf:
            buf.view(np.uint8)[...] = 0xFF  # NaN in f32, bf16 and e4m3
            seen["puts"] += 1
        put(self, buf)
        seen["cap"] = self.cap_bytes
        if self._free_bytes and self.held_bytes > self.cap_bytes:
            seen["over"].append(self.held_bytes)

    monkeypatch.setattr(host_pool.HostPool, "put", corrupting)
    _slow_slot_writes(monkeypatch, 512)
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=9)),
                            config, shards=2)
    cfg, whole = load_model(path, dtype=jnp.float32, keep_fp8_experts=keep_fp8, backend="tpu")
    assert cfg.num_hidden_layers >= 4  # layers repeat their leaves' shapes: buffers reused
    before = set(threading.enumerate())
    try:
        params, report = sharded_loader.load_sharded(
            path, cfg, _single_device(cfg, keep_fp8), dtype=jnp.float32,
            keep_fp8_experts=keep_fp8, backend="tpu", host_buffers=False, progress=False)
    finally:
        load_programs.writer.cache_clear()  # the slowed writes go with the monkeypatch
    assert_trees_equal(params, whole)
    assert not _new_threads(before)
    assert report.host_buffers["recycled"] > 0 and seen["puts"] > report.host_buffers["recycled"]
    assert seen["cap"] > 0 and not seen["over"]  # nothing kept past the cap


def test_pool_lends_a_returned_buffers_memory_to_other_shapes_within_the_slack():
    """A get with no returned buffer of its shape and dtype takes one of the same bytes, else
    the smallest of at most ``REUSE_SLACK`` times its bytes, as a view; the view goes back as
    that buffer. A buffer more than ``REUSE_SLACK`` times larger is not taken."""
    pool = host_pool.HostPool(cap_bytes=1 << 20)
    a, big = pool.get((16, 256), np.float32), pool.get((64, 256), np.float32)  # 16, 64 KiB
    pool.put(a)
    pool.put(big)
    v = pool.get((4096,), np.int32)  # a's bytes: a's memory, not big's
    assert v.shape == (4096,) and v.dtype == np.int32 and v.flags.c_contiguous
    assert np.shares_memory(v, a) and not np.shares_memory(v, big) and pool.recycled == 1
    assert pool.held_bytes == a.nbytes + big.nbytes
    pool.put(v)  # back as a
    assert pool.get((16, 256), np.float32) is a and pool.recycled == 2
    pool.put(a)
    w = pool.get((3000,), np.float32)  # 12000 bytes: within 2x of a's 16 KiB, not of big's
    assert np.shares_memory(w, a) and w.shape == (3000,) and pool.recycled == 3
    small = pool.get((1000,), np.float32)  # 4000 bytes: big is 16x that; a is out
    assert not np.shares_memory(small, big) and pool.fresh == 3
    pool.drop(w)  # a view dropped: its buffer is never handed out again
    assert pool.held_bytes == big.nbytes + small.nbytes
    assert not any(np.shares_memory(pool.get((16, 256), np.float32), x) for x in (a, big))


def test_in_flight_from_the_environment_scales_the_cap_and_the_leaves_held(
        tmp_path, monkeypatch):
    """``$STB_LOAD_IN_FLIGHT`` sets the leaves in flight (the pool's cap grows by one largest
    step per leaf): at most that many placed and not yet retired, the params unchanged."""
    monkeypatch.delenv("STB_LOAD_IN_FLIGHT", raising=False)
    assert sharded_loader.in_flight() == sharded_loader.IN_FLIGHT
    monkeypatch.setenv("STB_LOAD_IN_FLIGHT", "0")
    with pytest.raises(ValueError):
        sharded_loader.in_flight()
    config = nested_config()
    path = write_checkpoint(tmp_path / "ckpt", tensors_for(config, seed=3), config, shards=2)
    cfg, whole = load_model(path, dtype=jnp.float32, backend="tpu")
    seen = {"caps": [], "held": 0, "most": 0}
    place, retire, init = sharded_loader._place_leaf, host_pool.retire, host_pool.HostPool.__init__

    def placing(*a, **k):
        seen["held"] += 1
        seen["most"] = max(seen["most"], seen["held"])
        return place(*a, **k)

    def retiring(*a, **k):
        seen["held"] -= 1
        return retire(*a, **k)

    monkeypatch.setattr(sharded_loader, "_place_leaf", placing)
    monkeypatch.setattr(host_pool, "retire", retiring)
    monkeypatch.setattr(host_pool.HostPool, "__init__",
                        lambda self, cap: seen["caps"].append(cap) or init(self, cap))
    for n in (1, 3):
        monkeypatch.setenv("STB_LOAD_IN_FLIGHT", str(n))
        seen["most"] = seen["held"] = 0
        params, _ = sharded_loader.load_sharded(
            path, cfg, _single_device(cfg, False), dtype=jnp.float32, backend="tpu",
            host_buffers=False, progress=False)
        assert_trees_equal(params, whole)
        assert seen["most"] == n
    leaves = CheckpointLeaves(path, cfg, dtype=jnp.float32, keep_fp8_experts=False)
    steps = sharded_loader._plan(leaves, cfg, param_shapes(cfg, jnp.float32),
                                 _single_device(cfg, False))
    largest = max(sum(sharded_loader._job_bytes(st)) for st in steps)
    assert seen["caps"][1] - seen["caps"][0] == 2 * largest > 0
