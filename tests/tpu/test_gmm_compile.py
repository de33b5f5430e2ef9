"""gmm_swiglu and gmm (kernels/gmm.py) compiled by Mosaic for one TPU7x TensorCore.

Tiny shapes: M = T*k = 256 rows, K = H = 128, N = I = 64 (gate_up [16, 128, 128], down
[16, 64, 128]). Qwen3.5-397B per-device shapes: 64 local experts, H = 4096, I = 1024 (gate_up
[64, 4096, 2048], down [64, 1024, 4096]) at M = 64*10 (decode) and 2048*10 (prefill) rows.
Weights bf16, FP8 (float8_e4m3fn) with 128x128 block scales, and FP8 with quantize_lhs=True
(FP8 needs the SwiGLU half width I to be a multiple of 128, so the tiny FP8 case uses I=128).
Activations are bf16 throughout.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sglang_tpu_backend.kernels import gmm as G
from sglang_tpu_backend.kernels.tpu_compile import abstract, compile_for_tpu

FP8 = G.FP8_DTYPE
BLOCK = G.WEIGHT_BLOCK

# (label, M rows, E experts, H hidden, I intermediate)
SHAPES = [
    ("tiny", 256, 16, 128, 64),
    ("397B decode", 64 * 10, 64, 4096, 1024),
    ("397B prefill", 2048 * 10, 64, 4096, 1024),
]
WEIGHTS = ["bf16", "fp8", "fp8+quantize_lhs"]


def _cases():
    for label, m, e, h, i in SHAPES:
        for weights in WEIGHTS:
            if weights != "bf16" and label == "tiny":
                i = 128  # FP8 gmm_swiglu needs I % 128 == 0
            yield pytest.param(label, m, e, h, i, weights, id=f"{label.split()[-1]}-M{m}-{weights}")


def _weight_args(mesh, e, k, n, weights):
    """(rhs, rhs_scale) abstract arrays for an [E, N, K] weight (the checkpoint's [out, in]),
    scale None for bf16."""
    if weights == "bf16":
        return abstract((e, n, k), jnp.bfloat16, mesh), None
    scale = abstract((e, -(-n // BLOCK), -(-k // BLOCK)), jnp.float32, mesh)  # f32[E, N/128, K/128]
    return abstract((e, n, k), FP8, mesh), scale


@pytest.mark.parametrize("op", ["gmm_swiglu", "gmm"])
@pytest.mark.parametrize("label,m,e,h,i,weights", list(_cases()))
def test_gmm_compiles(mesh, record, op, label, m, e, h, i, weights):
    # gmm_swiglu: x [M, H] @ gate_up [E, 2I, H].T -> [M, I]; gmm (down): [M, I] @ [E, H, I].T -> [M, H]
    k, n, out = (h, 2 * i, i) if op == "gmm_swiglu" else (i, h, h)
    rhs, scale = _weight_args(mesh, e, k, n, weights)
    quantize = weights == "fp8+quantize_lhs"
    args = [abstract((m, k), jnp.bfloat16, mesh), rhs, abstract((e,), jnp.int32, mesh)]
    if scale is not None:
        args.append(scale)

    def fn(x, w, gs, s=None):
        return getattr(G, op)(x, w, gs, rhs_scale=s, quantize_lhs=quantize, impl="pallas")

    report = compile_for_tpu(fn, args, mesh)
    record(f"{op} {label} M={m} rhs [{e},{n},{k}] {weights}", report)
    assert len(report.kernels) == 1
    assert report.memory["output_size_in_bytes"] >= m * out * 2


@pytest.mark.parametrize("m", [64 * 10, 8 * 64 * 10, 2048 * 10], ids=["M640", "M5120", "M20480"])
def test_down_projection_row_split_compiles(mesh, record, m):
    """The MoE's down projection as the EP step runs it: FP8 [64, 4096, 1024], rows past the
    groups skipped, output written as [M, 16, 256] row slabs (full-width tiles, tn = 4096),
    and a CostEstimate that charges ``cost_rows``, not M."""
    e, i, h, p = 64, 1024, 4096, 16
    rhs, scale = _weight_args(mesh, e, i, h, "fp8")
    args = [abstract((m, i), jnp.bfloat16, mesh), rhs, abstract((e,), jnp.int32, mesh), scale]
    cost_rows = m // 8  # one EP device's share of the gathered rows

    def fn(x, w, gs, s):
        return G.gmm(x, w, gs, rhs_scale=s, impl="pallas", skip_tail=True, cost_rows=cost_rows,
                     row_split=p)

    report = record(f"gmm down M={m} row_split={p} fp8", compile_for_tpu(fn, args, mesh))
    assert len(report.kernels) == 1
    assert report.memory["output_size_in_bytes"] == m * h * 2  # [M, 16, 256] bf16, no slice copy
    # the kernel's estimate plus XLA's own few flops of the visit-list metadata
    assert abs(report.cost["flops"] / (2 * cost_rows * i * h) - 1) < 1e-3, report.cost
