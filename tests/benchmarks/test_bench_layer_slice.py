"""benchmarks/bench_layer_slice.py on the CPU with the tiny model: the step it times is the
model's forward on the slice (its logits equal the XLA path's on the same params, cache and
batch), and its prediction charges the slice it ran (its layers, its experts, its KV)."""

from __future__ import annotations


import numpy as np

from sglang_tpu_backend.config import FULL_ATTENTION
from tests.scripts import load_script

ARGS = ["--preset", "tiny", "--layers", "4", "--ep", "2", "--requests", "4", "--context", "64",
        "--page", "16", "--expert-dtype", "bf16", "--state-dtype", "f32", "--warmup", "1",
        "--iters", "2"]


def load_bench():
    return load_script("benchmarks/bench_layer_slice.py")


def test_the_timed_step_is_the_slices_forward_and_the_prediction_charges_that_slice():
    bench = load_bench()
    out = bench.main(ARGS + ["--impl", "xla"])
    assert out["finite"] and out["measured_ms"] > 0 and out["predicted_ms"] > 0
    base = bench.load_model_config(bench.ASSET_DIR)
    cfg = bench.slice_config(base, 4, base.num_experts // 2)
    assert out["local_experts"] == cfg.num_experts == base.num_experts // 2
    n_attn = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    assert n_attn == 1  # one layer period: 3 GDN + 1 attention
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    assert out["terms"]["kv_bytes"] == n_attn * (4 * 64 + 4) * kv_row
    # The step it times computes the forward: the Pallas kernels (interpret mode) on the
    # same params, cache and batch give the XLA path's logits.
    args = bench.parse_args(ARGS + ["--impl", "xla"])
    step, params, cache, batch = bench.build(cfg, args)
    want = np.asarray(step(params, cache, batch)[0])
    args = bench.parse_args(ARGS + ["--impl", "interpret"])
    step, params, cache, batch = bench.build(cfg, args)
    got = np.asarray(step(params, cache, batch)[0])
    assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max())
    assert np.abs(want).max() > 0  # not a zero output that any path would match
