"""Collectives (kernels/collectives.py) compiled for the full 8-device TPU7x host, inside shard_map.

The mesh is ``tpu7x:2x2x1`` as 4 chips x 2 dies (axes ("chip", "die")), as in serving.
hierarchical_reduce_scatter runs its remote-DMA Pallas kernel (impl="pallas") at 1, 2 and 4
micro-batches, at the Qwen3.5-397B size (each device reduces the MoE output of all 8 x 1024
gathered tokens, x [8192, 4096] bf16, and keeps its own 1024 rows) and a tiny size
(x [512, 128] bf16). packed_all_gather is plain lax (no Mosaic kernel): its test asserts that
the compiled HLO holds exactly one all-gather, for the 397B routing metadata (1024 tokens x
top-10 per device) and a tiny one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from sglang_tpu_backend.kernels import collectives as col
from sglang_tpu_backend.kernels.tpu_compile import abstract, compile_for_tpu, host_mesh

NUM_CHIPS, NUM_DIES = 4, 2
NUM_DEVICES = NUM_CHIPS * NUM_DIES
ROWS = P(("chip", "die"))  # row blocks over all 8 devices, device c*2+e owns block c*2+e

# (label, rows N per device, H, dtype)
RS_SIZES = [
    ("tiny", 512, 128, jnp.bfloat16),
    ("397B 8x1024 tokens", NUM_DEVICES * 1024, 4096, jnp.bfloat16),
]
# (label, tokens T per device, top-k)
AG_SIZES = [("tiny", 8, 4), ("397B", 1024, 10)]


@pytest.fixture(scope="module")
def host():
    """All 8 TensorCores of one Ironwood host as (chip=4, die=2)."""
    return host_mesh(("chip", "die"), (NUM_CHIPS, NUM_DIES))


def _shard_map(f, mesh, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def _count(hlo: str, op: str) -> int:
    """Instructions of ``op`` (sync or async start) in compiled HLO text."""
    return len(re.findall(rf"\s{op}(?:-start)?\(", hlo))


@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
@pytest.mark.parametrize("label,n,h,dtype", RS_SIZES, ids=[s[0].split()[0] for s in RS_SIZES])
def test_hierarchical_reduce_scatter_compiles(host, record, label, n, h, dtype, num_microbatches):
    def body(x):  # x [N, H] per device -> [N / 8, H]
        return col.hierarchical_reduce_scatter(
            x, chip_axis="chip", die_axis="die", num_microbatches=num_microbatches, impl="pallas")

    fn = _shard_map(body, host, in_specs=(ROWS,), out_specs=ROWS)
    args = [abstract((NUM_DEVICES * n, h), dtype, host, ROWS)]  # global [8N, H]
    report = compile_for_tpu(fn, args, host)
    record(f"hierarchical_reduce_scatter {label} x [{n},{h}] {jnp.dtype(dtype).name} "
           f"M={num_microbatches}", report)
    assert len(report.kernels) == 1 and report.kernels[0].vmem_limit_bytes > 0
    # The kernel moves every row itself: no XLA collective is left in the program.
    for op in ("reduce-scatter", "all-reduce", "all-gather", "all-to-all", "collective-permute"):
        assert _count(report.hlo, op) == 0, op
    rows_out = n // NUM_DEVICES
    assert report.memory["output_size_in_bytes"] >= rows_out * h * jnp.dtype(dtype).itemsize
    r = rows_out // num_microbatches  # the kernel's two [R, H] VMEM tiles
    assert report.kernels[0].vmem_used_bytes >= 2 * r * h * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("label,t,k", AG_SIZES, ids=[s[0] for s in AG_SIZES])
def test_packed_all_gather_is_one_all_gather(host, record, label, t, k):
    def body(ids, w):  # i32[T, k], f32[T, k] -> i32[8T, k], f32[8T, k] on every device
        return col.packed_all_gather(ids, w, axis_name=("chip", "die"))

    # Each device's gathered copy is stacked (as tests/kernels/test_collectives.py does): the
    # gathered values are not statically known to be replicated.
    fn = _shard_map(body, host, in_specs=(ROWS, ROWS), out_specs=(ROWS, ROWS))
    args = [abstract((NUM_DEVICES * t, k), jnp.int32, host, ROWS),
            abstract((NUM_DEVICES * t, k), jnp.float32, host, ROWS)]
    report = compile_for_tpu(fn, args, host)
    record(f"packed_all_gather {label} [{t},{k}] x {NUM_DEVICES} devices", report, min_kernels=0)
    assert _count(report.hlo, "all-gather") == 1, [
        line for line in report.hlo.splitlines() if "all-gather" in line]
    assert "s32[" in next(line for line in report.hlo.splitlines()
                          if re.search(r"\sall-gather(?:-start)?\(", line))  # one int32 payload
    assert report.kernels == ()
