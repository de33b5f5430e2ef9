"""The 397B DP8 x EP8 TARGET_VERIFY step (speculative decoding, k = 3 drafts: n = 4 rows per
request) compiled for one Ironwood host, at 9K-token contexts, FP8 experts, FP8 KV cache, bf16
GDN state.

A verify step must keep every GDN layer's state after each of the n positions until the
acceptance is known (``model_executor/verify.VerifyStates``): 45 layers x n x 2 MiB per
request. The planner counts them (``plan --speculative-num-draft-tokens``), and the largest
batch it plans is what the compiler fits: its figure is within 2% of the compiler's argument +
temporary + non-aliased output bytes. 512 requests per host (64 per DP rank), which the plain
decode step fits, does not fit with n = 4, and XLA:TPU refuses that program.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernels.tpu_compile import topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.plan import plan

from .test_dp_compile import PAGES, config_397b

D, N = 8, 4  # DP ranks; rows per request (the last token + 3 drafts)
SIZES = dict(context_length=9216, page_size=256, expert_dtype="fp8", dtype="bf16",
             kv_dtype="fp8", state_dtype="bf16", max_num_batched_tokens=1024)


def _compile(r: int):
    spec = StepSpec(ForwardMode.TARGET_VERIFY, r * N, r, r * N, PAGES, r * PAGES, 256, r)
    return compile_dp_step(config_397b(), spec, make_mesh(D, topology_devices("tpu7x:2x2x1")),
                           fp8_experts=True, kv_dtype=jnp.float8_e4m3fn,
                           state_dtype=jnp.bfloat16)


def test_397b_verify_step_fits_at_the_planners_batch(record):
    cfg = config_397b()
    p = plan(cfg, "tpu7x:2x2x1", dp=D, ep=D, tp=1, num_draft_tokens=N, **SIZES)
    r = p.requests_per_device
    assert 0 < p.max_running_requests < 512 <= plan(cfg, "tpu7x:2x2x1", dp=D, ep=D, tp=1,
                                                      **SIZES).max_running_requests
    report = record(f"DP{D}xEP{D} 397B TARGET_VERIFY n={N}, {r} requests/rank, KV fp8",
                    _compile(r), min_kernels=5)
    m = report.memory
    used = (m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
            + m["output_size_in_bytes"] - m["alias_size_in_bytes"])
    print(f"\n397B verify n={N}: {p.max_running_requests} requests per host; compiler "
          f"{used / 2**30:.2f} GiB, planner {p.total / 2**30:.2f} GiB per device")
    assert abs(p.total / used - 1) < 0.02, (p.total, m)


def test_397b_verify_step_at_512_requests_does_not_fit():
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        _compile(512 // D)
