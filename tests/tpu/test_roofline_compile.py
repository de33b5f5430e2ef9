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

The compiled roofline (``planning/compiled_roofline.py``) charges every op of a compiled program: a
made-up op raises, a loop body is charged once per trip, its FLOPs on the 4-layer slice are
XLA's, and the program efficiency (the roofline's ideal / the charged cost) of the decode
step (HBM bytes: the full 60-layer program, shared with ``test_dp_compile.py``, and the slice)
and of the full 1,024-token prefill step (FLOPs) is printed per layer kind and held to its
target. The full decode step's bytes efficiency went 0.859 -> 0.950 when the projections whose
outputs split into heads stopped letting XLA move that reshape onto the weight
(``qwen3_5_moe._project``): under the layer scan, XLA:TPU had copied each layer's slice of
q_proj, in_proj_z, k_proj and v_proj out of the stacked weights on every trip (10.3 GB per
step); a one-trip slice never showed it.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from sglang_tpu_backend.kernels.tpu_compile import NO_VMEM_PREFETCH, topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.planning.compiled_roofline import TPU7X, UnchargedOpError
from sglang_tpu_backend.planning.compiled_timeline import program_cost
from sglang_tpu_backend.planning.program_roofline import bucket_efficiency, format_efficiency
from sglang_tpu_backend.planning.roofline import step_terms, totals

from .test_dp_compile import PAGES, compile_397b, config_397b

D, R, PAGE = 8, 64, 256


@functools.lru_cache(maxsize=None)
def compiled_step(num_layers: int, mode: ForwardMode, T: int):
    mesh = make_mesh(D, topology_devices("tpu7x:2x2x1"))
    spec = StepSpec(mode, T, R, R, PAGES, R * PAGES, PAGE, R)
    return compile_dp_step(config_397b(num_layers), spec, mesh, fp8_experts=True,
                           state_dtype=jnp.bfloat16, compiler_options=NO_VMEM_PREFETCH)


def compiled_cost(num_layers: int, mode: ForwardMode, T: int) -> dict:
    return compiled_step(num_layers, mode, T).cost


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


# A loop of 8 trips whose body slices one [1024, 1024] bf16 layer out of a stacked weight.
SCAN_HLO = """HloModule scan

%slice_layer (p0: bf16[8,1024,1024], p1: s32[]) -> bf16[1,1024,1024] {
  %p0 = bf16[8,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,1024,1024}
}

%body (t: (s32[], bf16[8,1024,1024], bf16[1,1024,1024])) -> (s32[], bf16[8,1024,1024], bf16[1,1024,1024]) {
  %t = (s32[], bf16[8,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[8,1024,1024]{2,1,0} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %layer = bf16[1,1024,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%slice_layer
  ROOT %out = (s32[], bf16[8,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) tuple(%next, %w, %layer)
}

%cond (t: (s32[], bf16[8,1024,1024], bf16[1,1024,1024])) -> pred[] {
  %t = (s32[], bf16[8,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: bf16[8,1024,1024], s: bf16[1,1024,1024]) -> (s32[], bf16[8,1024,1024], bf16[1,1024,1024]) {
  %w = bf16[8,1024,1024]{2,1,0} parameter(0)
  %s = bf16[1,1024,1024]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) tuple(%zero, %w, %s)
  ROOT %loop = (s32[], bf16[8,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_scan_body_is_charged_once_per_trip():
    """The trip count from the condition (counter from 0, ``i < 8``): each trip reads one
    layer's slice (2 MiB, not the 16 MiB stack) and its s32 index and writes the slice, and
    adds two s32; the condition runs 9 times (two s32 in, one pred out)."""
    c = program_cost(SCAN_HLO).total
    layer = 1024 * 1024 * 2
    assert c.hbm_bytes == 8 * (2 * layer + 4 + 12) + 9 * 9
    assert c.ops == 8 * 2 + 9
    with pytest.raises(UnchargedOpError, match="by 1"):  # a counter stepping by 2
        program_cost(SCAN_HLO.replace("constant(1)", "constant(2)"))
    # A jax scan compiled for the CPU carries its trip count (known_trip_count): the body's
    # dot is charged per trip.
    def program(n):
        def run(x, w):
            return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=n)[0]
        x = jnp.ones((64, 64), jnp.float32)
        return jax.jit(run).lower(x, x).compile().as_text()
    for n in (4, 8):
        assert program_cost(program(n)).total.flops == n * 2 * 64**3


# An async all-gather with a dot scheduled inside its window (``{inside}``) or after it.
ASYNC_HLO = """HloModule overlap

ENTRY %main (a: bf16[2048,2048], w: bf16[2048,2048], x: bf16[256,4096]) -> (bf16[2048,2048], bf16[2048,4096]) {
  %a = bf16[2048,2048]{1,0} parameter(0)
  %w = bf16[2048,2048]{1,0} parameter(1)
  %x = bf16[256,4096]{1,0} parameter(2)
  %ags = (bf16[256,4096]{1,0}, bf16[2048,4096]{1,0}) all-gather-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  {inside}
  %agd = bf16[2048,4096]{1,0} all-gather-done(%ags)
  {after}
  ROOT %t = (bf16[2048,2048]{1,0}, bf16[2048,4096]{1,0}) tuple(%dot, %agd)
}
"""
_DOT = ("%dot = bf16[2048,2048]{1,0} dot(%a, %w), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}")


@pytest.mark.parametrize("scale", [1, 8], ids=["comm-bound", "compute-bound"])
def test_async_window_is_charged_its_longer_side(scale):
    """The overlap-aware time charges an async window max(transfer, compute inside it); the
    serial time (and a window with nothing inside) their sum. ``scale`` grows the dot so
    that either side is the longer one."""
    n = 2048 * scale
    hlo = ASYNC_HLO.replace("2048,2048", f"{n},{n}")
    inside = program_cost(hlo.replace("{inside}", _DOT.replace("2048,2048", f"{n},{n}"))
                          .replace("{after}", ""))
    after = program_cost(hlo.replace("{after}", _DOT.replace("2048,2048", f"{n},{n}"))
                         .replace("{inside}", ""))
    comm = inside.kinds["communication"].seconds
    compute = inside.total.seconds - comm
    assert comm > 0 and compute > 0
    assert (comm > compute) == (scale == 1)
    assert inside.total.seconds == pytest.approx(after.total.seconds)
    assert inside.overlap_seconds == pytest.approx(max(comm, compute))
    assert after.overlap_seconds == pytest.approx(comm + compute)
    # A program without async windows: the two times agree.
    scan = program_cost(SCAN_HLO)
    assert scan.overlap_seconds == pytest.approx(scan.total.seconds)


@pytest.mark.parametrize("op,error", [
    ("%bogus = s32[] frobnicate(%i)", "frobnicate"),
    ('%bogus = s32[] custom-call(%i), custom_call_target="MadeUpTarget"', "MadeUpTarget"),
], ids=["opcode", "custom-call-target"])
def test_an_op_without_a_cost_rule_raises(op, error):
    hlo = SCAN_HLO.replace("  %one = s32[] constant(1)\n", f"  %one = s32[] constant(1)\n  {op}\n")
    with pytest.raises(UnchargedOpError, match=error):
        program_cost(hlo)


def _bucket(name: str, num_layers: int | None, T: int):
    mode = ForwardMode.DECODE if name == "decode" else ForwardMode.EXTEND
    report = (compile_397b("tpu7x:2x2x1", D, mode, T) if num_layers is None
              else compiled_step(num_layers, mode, T))
    cfg = config_397b(num_layers)
    return report, bucket_efficiency(name, report.hlo, cfg, tokens=T, seqs=R,
                                     kv_len=PAGES * PAGE, devices=D, device=TPU7X)


@pytest.mark.parametrize("name,num_layers,T,target", [
    ("decode", None, 64, 0.9),
    ("decode", 4, 64, 0.9),
    ("prefill", None, 1024, 0.85),
], ids=["decode64-60layers", "decode64-4layers", "prefill1024-60layers"])
def test_program_efficiency(name, num_layers, T, target):
    """Every op of the compiled step is charged (the walk raises otherwise), FLOPs within
    0.5% of XLA's on the one-trip slice (where XLA's count is the program's), and the
    efficiency that bounds the bucket (decode: HBM bytes, prefill: FLOPs) meets its target."""
    report, b = _bucket(name, num_layers, T)
    layers = num_layers or 60
    print(f"\n397B DP8 x EP8 {name} ({T} tokens per rank, {layers} layers), per device:\n"
          + format_efficiency(b))
    if num_layers is not None:
        assert abs(b.charged.total.flops / report.cost["flops"] - 1) < 0.005
    assert b.efficiency >= target, (name, b.ratios())
