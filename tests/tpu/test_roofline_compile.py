"""The roofline's per-step FLOPs and HBM bytes against XLA's cost_analysis() of the compiled
397B DP x EP step (tpu7x:2x2x1, DP8 x EP8, FP8 experts, bf16 GDN state, 64 requests per rank
at 9K-token contexts, page 256: every request's page row is full, so the attention kernel's
static cost, which assumes full rows, and the roofline describe the same batch).

How the two are compared consistently:
- FLOPs and bytes on a 4-layer slice (one group of 3 GDN + 1 attention layers: the layer scan
  runs its body once, and XLA's cost analysis counts a loop body once; a bytes slope between
  an 8- and a 4-layer compile is no way around it, the body is counted once whatever the
  trip count).
- Compiled without VMEM prefetching (``NO_VMEM_PREFETCH``: XLA's cost analysis otherwise
  charges every HBM->VMEM prefetch as extra bytes on top of its consumer). A Pallas call is
  then charged exactly its CostEstimate, a gather only the rows it reads (halving the
  vocabulary moves the total by the lm_head half alone).
- The MoE kernels move only the rows routed to this device's experts (``models/moe.py``:
  ``skip_tail``), and their cost estimates charge the balanced-routing share, T*K of the
  D*T*K all-gathered rows, as the roofline does.

The roofline counts only what a step must move (dense weights, touched experts, KV pages,
GDN state, lm_head): 8.34 GB for the decode slice. XLA's bytes went 12.83 GB (prefetch
accounting) -> 12.03 (without) -> 10.69 (``q_proj`` / ``in_proj_z`` stored output-major,
``weight_layout.py``: each layer's slice of both had been relaid out on every step) -> 9.88
(the MoE kernels skip other devices' rows) -> 9.21 GB (the down projection writes its rows
as [M, P, H/P] slabs, ``gmm(row_split=P)``, so the un-permute's relayout copy of the expert
outputs, charged 169 MB per layer, is gone). The 10% left is activation traffic the roofline
leaves out: f32 logits, the all-gathered hidden rows, the routed rows between the MoE
kernels, per-layer activations between fusions.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kernels.tpu_compile import NO_VMEM_PREFETCH, topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.roofline import step_terms, totals

from .test_dp_compile import PAGES, config_397b

D, R, PAGE = 8, 64, 256


@functools.lru_cache(maxsize=None)
def compiled_cost(num_layers: int, mode: ForwardMode, T: int) -> dict:
    mesh = make_mesh(D, topology_devices("tpu7x:2x2x1"))
    spec = StepSpec(mode, T, R, R, PAGES, R * PAGES, PAGE, R)
    return compile_dp_step(config_397b(num_layers), spec, mesh, fp8_experts=True,
                           state_dtype=jnp.bfloat16, compiler_options=NO_VMEM_PREFETCH).cost


def roofline(num_layers: int, mode: ForwardMode, T: int) -> dict:
    return step_terms(config_397b(num_layers), tokens=T, seqs=R, kv_len=PAGES * PAGE, devices=D,
                      logits_rows=R, decode=mode == ForwardMode.DECODE, expert_dtype="fp8",
                      state_dtype="bf16")


@pytest.mark.parametrize("mode,T", [(ForwardMode.DECODE, 64), (ForwardMode.MIXED, 256)],
                         ids=["decode64", "mixed256"])
def test_flops_agree_with_xla_cost_analysis(mode, T):
    xla = compiled_cost(4, mode, T)["flops"]
    bf16, expert, _ = totals(roofline(4, mode, T))
    assert abs((bf16 + expert) / xla - 1) < 0.2, (bf16 + expert, xla)


def test_roofline_bytes_against_xla_cost_analysis():
    mode, T = ForwardMode.DECODE, 64
    xla = compiled_cost(4, mode, T)["bytes accessed"]
    ours = totals(roofline(4, mode, T))[2]
    print(f"\n397B decode slice bytes: roofline {ours / 1e9:.2f} GB, XLA {xla / 1e9:.2f} GB, "
          f"ratio {xla / ours:.3f}")
    assert ours <= xla <= 1.2 * ours, (ours, xla)
