"""gather_rows and gather_reduce (kernels/routing.py) compiled by Mosaic for one TPU7x TensorCore.

Tiny shapes (T=64, H=128, top-k 4 of 16 experts; f32 and bf16) and the Qwen3.5-397B per-device
shapes (H=4096, top-k 10, 64 local experts of 512, bf16): decode T=64 and T=512, prefill T=1024
and T=2048, and T=8192, the all-gathered tokens of 8 DP ranks x 1024. The index arrays reach
the kernels in per-grid-step SMEM blocks, so M = T*k = 81920 indices do not sit whole in SMEM.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from sglang_tpu_backend.kernels import routing as R
from sglang_tpu_backend.kernels.tpu_compile import abstract, compile_for_tpu

# (label, T tokens, H hidden, k top-k, dtype)
CASES = [
    ("tiny f32", 64, 128, 4, jnp.float32),
    ("tiny bf16", 64, 128, 4, jnp.bfloat16),
    ("397B decode", 64, 4096, 10, jnp.bfloat16),
    ("397B decode", 512, 4096, 10, jnp.bfloat16),
    ("397B prefill", 1024, 4096, 10, jnp.bfloat16),
    ("397B prefill", 2048, 4096, 10, jnp.bfloat16),
    ("397B all-gathered 8x1024", 8192, 4096, 10, jnp.bfloat16),
]
IDS = [f"{label.split()[0]}-T{t}-{jnp.dtype(dt).name}" for label, t, _, _, dt in CASES]


@pytest.mark.parametrize("label,t,h,k,dtype", CASES, ids=IDS)
def test_gather_rows_compiles(mesh, record, label, t, h, k, dtype):
    m = t * k
    args = [abstract((t, h), dtype, mesh), abstract((m,), jnp.int32, mesh),  # x [T, H], i32[M]
            abstract((), jnp.int32, mesh)]  # num_rows: blocks past it skipped

    def fn(x, idx, num):
        return R.gather_rows(x, idx, num_rows=num, impl="pallas")

    report = compile_for_tpu(fn, args, mesh)
    record(f"gather_rows {label} T={t} H={h} k={k} {jnp.dtype(dtype).name}", report)
    assert len(report.kernels) == 1
    assert report.memory["output_size_in_bytes"] >= m * h * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("label,t,h,k,dtype", CASES, ids=IDS)
def test_gather_reduce_compiles(mesh, record, label, t, h, k, dtype):
    m = t * k
    args = [
        abstract((m, h), dtype, mesh),  # y [M, H]
        abstract((t, k), jnp.int32, mesh),  # rows i32[T, k]
        abstract((t, k), jnp.float32, mesh),  # weights f32[T, k]
    ]
    report = compile_for_tpu(
        lambda y, rows, w: R.gather_reduce(y, rows, w, impl="pallas"), args, mesh)
    record(f"gather_reduce {label} T={t} H={h} k={k} {jnp.dtype(dtype).name}", report)
    assert len(report.kernels) == 1
    assert report.memory["output_size_in_bytes"] >= t * h * jnp.dtype(dtype).itemsize


def test_routed_moe_path_compiles(mesh, record):
    """route_metadata -> gather_rows -> gather_reduce in one program (decode, 397B shapes)."""
    t, h, k, e = 64, 4096, 10, 64

    def fn(topk_ids, x, w):
        token_idx, _, rows = R.route_metadata(topk_ids, e, expert_offset=0)
        xs = R.gather_rows(x, token_idx, impl="pallas")  # [T*k, H]
        return R.gather_reduce(xs, rows, w, impl="pallas")  # [T, H]

    args = [abstract((t, k), jnp.int32, mesh), abstract((t, h), jnp.bfloat16, mesh),
            abstract((t, k), jnp.float32, mesh)]
    report = record("route_metadata + gather_rows + gather_reduce 397B T=64",
                    compile_for_tpu(fn, args, mesh), min_kernels=2)
    assert len(report.kernels) == 2


# Other row splits P of the [rows, P, H/P] view (kernels/routing.py): f32 at the model's H
# (P = 8), H = 2560 bf16 (P = 4), H = 256 bf16 (P = 2), H = 200 f32 (P = 1, lanes padded),
# and an 8-bit gather_rows (P = 32), e.g. of FP8 activations.
LAYOUTS = [
    (512, 4096, 10, jnp.float32),
    (512, 2560, 8, jnp.bfloat16),
    (64, 256, 4, jnp.bfloat16),
    (64, 200, 4, jnp.float32),
]


@pytest.mark.parametrize("t,h,k,dtype", LAYOUTS,
                         ids=[f"H{h}-{jnp.dtype(dt).name}" for _, h, _, dt in LAYOUTS])
def test_other_row_splits_compile(mesh, record, t, h, k, dtype):
    name = f"T={t} H={h} k={k} {jnp.dtype(dtype).name} (P={R.row_split(h, dtype)})"
    args = [abstract((t, h), dtype, mesh), abstract((t * k,), jnp.int32, mesh)]
    record(f"gather_rows {name}",
           compile_for_tpu(lambda x, idx: R.gather_rows(x, idx, impl="pallas"), args, mesh))
    args = [abstract((t * k, h), dtype, mesh), abstract((t, k), jnp.int32, mesh),
            abstract((t, k), jnp.float32, mesh)]
    record(f"gather_reduce {name}", compile_for_tpu(
        lambda y, rows, w: R.gather_reduce(y, rows, w, impl="pallas"), args, mesh))


def test_fp8_gather_rows_compiles(mesh, record):
    args = [abstract((64, 4096), jnp.float8_e4m3fn, mesh), abstract((640,), jnp.int32, mesh)]
    record("gather_rows T=64 H=4096 k=10 float8_e4m3fn (P=32)",
           compile_for_tpu(lambda x, idx: R.gather_rows(x, idx, impl="pallas"), args, mesh))


def test_ep_moe_layer_has_no_relayout_of_routed_rows(mesh, record):
    """models/moe.routed_experts at one 397B EP device's decode shapes (8 ranks x 64 tokens
    all-gathered: x [512, 4096], 64 local FP8 experts): route, gather, two grouped matmuls and
    the un-permute are 4 Mosaic kernels, and nothing outside them copies an [M, H] array of
    routed rows (the down projection writes the [M, 16, 256] slabs gather_reduce reads)."""
    from sglang_tpu_backend.models.moe import routed_experts

    t, h, i, k, e = 512, 4096, 1024, 10, 64
    fp8, blk = jnp.float8_e4m3fn, 128
    experts = {"gate_up": abstract((e, 2 * i, h), fp8, mesh),
               "gate_up_scale": abstract((e, 2 * i // blk, h // blk), jnp.float32, mesh),
               "down": abstract((e, h, i), fp8, mesh),
               "down_scale": abstract((e, h // blk, i // blk), jnp.float32, mesh)}
    args = [experts, abstract((t, h), jnp.bfloat16, mesh), abstract((t, k), jnp.int32, mesh),
            abstract((t, k), jnp.float32, mesh)]

    def fn(ex, x, ids, w):
        return routed_experts(ex, x, ids, w, e, 0, "pallas", expected_rows=t * k // 8)

    report = record("EP MoE layer 397B decode (8 x 64 tokens)", compile_for_tpu(fn, args, mesh),
                    min_kernels=4)
    assert len(report.kernels) == 4
    m_h = rf"bf16\[{t * k},{h}\]|bf16\[{t * k},16,256\]|bf16\[{t * k // 8},8,16,256\]"
    copies = [ln for ln in report.hlo.splitlines()
              if re.search(rf"= ({m_h})\S* (copy|fusion|call-start)\(", ln)]
    assert not copies, copies
