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
