"""benchmarks/bench_load.py's put run on the CPU: the load's leaves moved from host memory to
the devices at each count in flight, the bytes of the params the load places."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from sglang_tpu_backend.model_loader.checkpoint_io import quantize_checkpoint_fp8, write_checkpoint
from sglang_tpu_backend.model_loader.sharded_loader import load_sharded
from sglang_tpu_backend.models.param_shapes import num_param_bytes
from tests.model.test_loader import nested_config, tensors_for
from tests.scripts import load_script


def load_bench():
    return load_script("benchmarks/bench_load.py")


def test_put_moves_the_loads_bytes_at_each_count_in_flight(tmp_path):
    bench = load_bench()
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=5)),
                            config, shards=2)
    r = bench.run_put(path, 1, [1, 2, 4])
    assert set(r["seconds"]) == {1, 2, 4} and all(s > 0 for s in r["seconds"].values())
    cfg, shardings = bench._placement(path, 1)
    params, _ = load_sharded(path, cfg, shardings, dtype=jnp.bfloat16, keep_fp8_experts=True,
                             backend="tpu", host_buffers=False, progress=False)
    assert r["bytes"] == num_param_bytes(params) > 0  # every leaf once, as placed
    buf = jnp.zeros((4, 8)).__array__()
    items = [(buf, jax.sharding.SingleDeviceSharding(jax.devices()[0]))] * 5
    assert bench._put_seconds(items, 2) > 0


def test_touch_faults_every_page_where_the_kernel_lacks_populate(tmp_path, monkeypatch):
    """On a kernel without MADV_POPULATE_WRITE (the chip host's: the touch run reported 8.31 GB
    in 0.00 s), the Populator says so and the touch run faults the memory by writes."""
    from sglang_tpu_backend.model_loader import host_load

    bench = load_bench()
    (tmp_path / "a.safetensors").write_bytes(b"\0" * (3 << 20))
    monkeypatch.setattr(host_load, "_MADV_POPULATE_WRITE", 9999)  # an advice no kernel knows
    buf = host_load.host_empty((1 << 20,), jnp.uint8.dtype)
    populator = host_load.Populator([buf])
    populator.stop_when_done()
    assert populator.supported is False
    r = bench.run_touch(tmp_path)
    assert r["bytes"] == 3 << 20 and r["populate"] is False and r["seconds"] > 0
