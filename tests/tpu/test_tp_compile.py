"""The full Qwen3.5-397B step with tensor-parallel attention (parallel/tp_forward.py) compiled
for one Ironwood host (tpu7x:2x2x1, TP8 + EP8), the comparison point of the DP8 + EP8 step.

With 2 kv heads and 8 devices, every device holds one kv head for every running request, so
the KV cache per device is 4x that of DP attention at the same concurrency. Asserts, with the
planner's pools (bf16 KV, 9K contexts):
- 256 running requests compile and fit a TensorCore's HBM, the planner within 10% of the
  compiler's argument + temporary bytes;
- 512 running requests (which the DP8 step fits, tests/tpu/test_dp_compile.py) do not: the
  planner says so and XLA:TPU refuses to compile for lack of HBM;
- the tensor-parallel data flow: all-reduces complete the token mixers' output projections
  and the routed experts (two per layer of the scan body), and no layer all-gathers tokens.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from sglang_tpu_backend.kernels.tpu_compile import topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_tp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.planning.plan import plan
from tests.tpu.test_dp_compile import PAGES, config_397b

TOPOLOGY = "tpu7x:2x2x1"


def tp_plan(cfg, running_requests: int):
    return plan(cfg, TOPOLOGY, dp=1, ep=8, tp=8, running_requests=running_requests,
                context_length=9216, page_size=256, expert_dtype="fp8", dtype="bf16",
                kv_dtype="bf16", state_dtype="bf16", max_num_batched_tokens=1024)


def compile_tp(cfg, R: int):
    spec = StepSpec(ForwardMode.DECODE, R, R, R, PAGES, R * PAGES, 256, R)
    return compile_tp_step(cfg, spec, make_mesh(8, topology_devices(TOPOLOGY)),
                           fp8_experts=True, state_dtype=jnp.bfloat16)


def test_tp8_397b_fits_256_requests(record):
    cfg = config_397b()
    p = tp_plan(cfg, 256)
    assert p.requests_per_device == 256 and p.headroom > 0
    report = record("TP8xEP8 tpu7x:2x2x1 397B (60 layers) DECODE R=256", compile_tp(cfg, 256),
                    min_kernels=5)
    used = report.memory["argument_size_in_bytes"] + report.memory["temp_size_in_bytes"]
    assert used <= p.hbm, (used, p.hbm)
    assert abs(p.total / used - 1) < 0.10, (p.total, report.memory)
    body_layers = cfg.layer_period
    all_reduces = len(re.findall(r" all-reduce(?:-start)?\(", report.hlo))
    assert all_reduces == 2 * body_layers, all_reduces
    assert len(re.findall(r" all-gather(?:-start)?\(", report.hlo)) == 0


def test_tp8_397b_does_not_fit_512_requests():
    cfg = config_397b()
    p = tp_plan(cfg, 512)
    assert p.headroom < 0 and p.max_running_requests < 512
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        compile_tp(cfg, 512)


def test_tp8_397b_nextn_verify_step_with_the_mtp_layer_compiles(record):
    """The whole NEXTN verify step at TP8 in one program (the verify forward with hidden
    states, the commit, the MTP pass and its chain of 3 drafts; ``TPForward``'s programs) at
    64 requests: the Pallas kernels compile at the local head counts (the GDN verify and
    commit kernels on a device's 8 value heads and 2 key heads, the MTP layer's attention on
    its one replicated kv head), it fits the planner's HBM, and the only collectives are the
    all-reduces of the main layers (two per layer of the scan body) and of the MTP layer
    (two per draft step): the commit needs none."""
    from sglang_tpu_backend.model_executor.step_compile import compile_tp_verify_with_mtp

    cfg, R, n = config_397b(), 64, 4
    spec = StepSpec(ForwardMode.TARGET_VERIFY, R * n, R, R * n, PAGES, R * PAGES, 256, R)
    report = record(f"TP8xEP8 397B NEXTN verify n={n} + MTP, {R} requests",
                    compile_tp_verify_with_mtp(cfg, spec, make_mesh(8, topology_devices(TOPOLOGY)),
                                               num_steps=n - 1, fp8_experts=True,
                                               state_dtype=jnp.bfloat16), min_kernels=5)
    m = report.memory
    used = (m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
            + m["output_size_in_bytes"] - m["alias_size_in_bytes"])
    assert used <= tp_plan(cfg, R).hbm, m
    all_reduces = len(re.findall(r" all-reduce(?:-start)?\(", report.hlo))
    assert all_reduces == 2 * cfg.layer_period + 2 * (n - 1), all_reduces
    assert len(re.findall(r" all-gather(?:-start)?\(", report.hlo)) == 0
