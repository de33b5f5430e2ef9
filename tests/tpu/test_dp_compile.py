"""The full Qwen3.5-397B DP x EP step (parallel/dp_forward.py) compiled for one Ironwood host
(tpu7x:2x2x1, DP8 x EP8) and for two (tpu7x:2x2x2, DP16 x EP16).

All 60 layers (a scan over 15 groups of 3 GDN + 1 attention layers), all 512 experts split
over the TensorCores in FP8, bf16 attention/GDN weights, 512 running requests per host (64 per
DP rank) at 9K-token contexts, page 256, KV and GDN pools sized by the planner. Asserts:
- it fits: the compiler's argument + temporary bytes per device are within a TensorCore's HBM,
  and the planner's estimate is within 10% of that figure (its resident bytes, weights + KV +
  GDN state, within 1% of the compiler's argument bytes);
- the MoE data flow the design calls for: per MoE layer of the scan body exactly one
  all-gather of routing metadata (top-k ids and weights packed into one int32 array), one
  all-gather of hidden states, and the Mosaic remote-DMA reduce-scatter kernel (no XLA
  reduce-scatter or all-reduce).
One single-host step stores the experts in 544 physical slots (EPLB: 32 redundant, 68 per
device; the step maps routed ids to slots) and checks the planner counts their bytes; it also
keeps the KV cache in FP8 with per-row f32 scales (``--kv-cache-dtype fp8_e4m3``), which the
planner's KV bytes must count too.
Overlap: in the scheduled decode step each MoE layer's hidden-state all-gather runs async (on
the SparseCore) with TensorCore compute, the routing computation among it, between its start
and done. (The MoE combine overlapped with the expert matmuls, once compiled and counted here,
lost at every 397B shape measured and is gone: README.)
The compile time of each program is printed in the end-of-run table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.kernels.tpu_compile import topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.models.param_shapes import param_shapes
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.planning.hlo_text import parse_module
from sglang_tpu_backend.planning.plan import plan

CONFIG_397B = (Path(__file__).resolve().parents[2] / "sglang_tpu_backend" / "assets" / "configs"
               / "qwen3.5-397b-a17b.json")
PAGES = 9216 // 256  # pages per request at 9K context


def config_397b(num_layers: int | None = None):
    """The 397B config, or its first ``num_layers`` layers."""
    cfg = model_config_from_dict(json.loads(CONFIG_397B.read_text()))
    if num_layers is None:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=num_layers,
                               layer_types=cfg.layer_types[:num_layers])


def count(hlo: str, pattern: str) -> int:
    return len(re.findall(pattern, hlo))


def all_gathers(hlo: str) -> list[tuple[str, int]]:
    """(dtype, element count) of every all-gather in compiled HLO text."""
    out = []
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dtype, n))
    return out


def unfused_computations(hlo: str) -> list[str]:
    """The computations of compiled HLO text whose instructions own buffers: all but fusion
    bodies (whose instructions are computed in registers/VMEM inside one fused kernel)."""
    fused = set(re.findall(r"\bfusion\([^\n]*?calls=(%[\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo)
    return [b for b in blocks if b.split(" ", 1)[0] not in fused
            and b.replace("ENTRY ", "").split(" ", 1)[0] not in fused]


def relaid_out_weights(hlo: str, cfg) -> list[str]:
    """Dense weights (bf16, both matrix dims >= 1024) that the program copies in HBM, e.g. into
    another tiling or dimension order: instructions outside fusion bodies producing a weight's
    shape in HBM, as the whole stack ``[groups, K, N]`` or one layer's slice ``[1, K, N]``
    (the form the layer scan slices; a bare ``[K, N]`` would also match activations such as
    the all-gathered hidden rows), other than the parameter itself and views of it. Stored as
    ``weight_layout.py`` says there are none."""

    groups = cfg.num_hidden_layers // cfg.layer_period
    shapes = set()
    for s in jax.tree.leaves(param_shapes(cfg, jnp.bfloat16, fp8_experts=True)):
        if s.dtype == jnp.bfloat16 and s.ndim == 3 and s.shape[0] == groups \
                and min(s.shape[1:]) >= 1024:
            k, n = s.shape[1:]
            shapes |= {f"bf16[{groups},{k},{n}]", f"bf16[1,{k},{n}]"}
    assert shapes
    found = []
    for block in unfused_computations(hlo):
        for shape in shapes:
            for layout, op in re.findall(rf"= {re.escape(shape)}{{([^}}]*)}} ([\w-]+)\(", block):
                if "S(1)" in layout:  # memory space 1 is VMEM: a prefetch, not an HBM copy
                    continue
                if op not in ("parameter", "get-tuple-element", "bitcast", "while", "tuple",
                              "dynamic-slice", "fusion"):
                    found.append(f"{op} -> {shape}{{{layout}}}")
    return found


@functools.lru_cache(maxsize=None)
def compile_397b(topology: str, D: int, mode: ForwardMode, T: int, redundant: int = 0,
                 kv: str = "bf16"):
    """The full 397B DP x EP step (64 requests per rank at 9K contexts, FP8 experts, bf16 GDN
    state), compiled once per session (``test_roofline_compile.py`` charges the decode one)."""
    mesh = make_mesh(D, topology_devices(topology))
    spec = StepSpec(mode, T, 64, 64, PAGES, 64 * PAGES, 256, 64)  # per DP rank
    kv_dtype = jnp.float8_e4m3fn if kv == "fp8" else jnp.bfloat16
    return compile_dp_step(config_397b(), spec, mesh, fp8_experts=True, kv_dtype=kv_dtype,
                           state_dtype=jnp.bfloat16, redundant_experts=redundant)


@pytest.mark.parametrize("topology,D,mode,T,redundant,kv", [
    ("tpu7x:2x2x1", 8, ForwardMode.DECODE, 64, 0, "bf16"),
    # EPLB: 544 expert slots, 68 per device; FP8 KV cache with per-row scales.
    ("tpu7x:2x2x1", 8, ForwardMode.MIXED, 256, 32, "fp8"),
    ("tpu7x:2x2x2", 16, ForwardMode.DECODE, 64, 0, "bf16"),  # two hosts: DP16 x EP16
], ids=["1host-decode64", "1host-mixed256-redundant32-fp8kv", "2hosts-decode64"])
def test_full_397b_dp_ep_step_fits_with_one_routing_all_gather_per_layer(
        record, topology, D, mode, T, redundant, kv):
    cfg = config_397b()
    sizes = dict(running_requests=512, context_length=9216, page_size=256, expert_dtype="fp8",
                 dtype="bf16", kv_dtype=kv, state_dtype="bf16", max_num_batched_tokens=1024)
    p = plan(cfg, topology, dp=D, ep=D, tp=1, redundant_experts=redundant, **sizes)
    r = p.requests_per_device
    assert r == 64
    if redundant:  # the planner counts the redundant slots' bytes: (512 + 32) / 512 of them
        plain = plan(cfg, topology, dp=D, ep=D, tp=1, **sizes)
        assert p.expert_slots_per_device == (cfg.num_experts + redundant) // D == 68
        assert p.weights_sharded == plain.weights_sharded * 68 // 64
        assert 0 < p.weights_replicated - plain.weights_replicated < 8 << 20  # the maps
    report = compile_397b(topology, D, mode, T, redundant, kv)
    slots = f", {cfg.num_experts + redundant} expert slots" if redundant else ""
    record(f"DP{D}xEP{D} {topology} 397B (60 layers) {mode.name} T={T}/rank{slots}, KV {kv}",
           report, min_kernels=5)
    used = report.memory["argument_size_in_bytes"] + report.memory["temp_size_in_bytes"]
    assert used <= p.hbm, (used, p.hbm)  # one TensorCore's HBM share
    assert abs(p.total / used - 1) < 0.10, (p.total, report.memory)
    moe_layers_in_body = cfg.layer_period  # the scan body holds one group of layers
    k2 = 2 * cfg.num_experts_per_tok
    gathers = all_gathers(report.hlo)
    routing = gathers.count(("s32", D * T * k2))  # ids and weight bits in one int32 array
    hidden = gathers.count(("bf16", D * T * cfg.hidden_size))
    assert routing == moe_layers_in_body and hidden == moe_layers_in_body, gathers
    assert len(gathers) == 2 * moe_layers_in_body, gathers
    reduce_scatters = [k for k in report.kernels if k.has_communication]
    assert len(reduce_scatters) == moe_layers_in_body
    for op in ("reduce-scatter", "all-reduce"):
        assert count(report.hlo, rf" {op}(?:-start)?\(") == 0, op
    assert not relaid_out_weights(report.hlo, cfg)
    # The planner's resident bytes (weights + KV pages + GDN state) are the compiler's
    # argument bytes per device.
    resident = p.weights + p.kv_pages + p.gdn_state
    assert abs(report.memory["argument_size_in_bytes"] / resident - 1) < 0.01, (
        report.memory, resident)


@pytest.mark.parametrize("install", [True, False], ids=["install", "export"])
def test_397b_handover_programs_stay_rank_local(record, install):
    """The disaggregated decode (install) and prefill (export) programs of a 9K-token request
    (36 pages, bucket 64) over the DP8 x EP8 pools of one host: they compile for tpu7x, move
    no byte between devices (no collective), and need scratch of the request's size, not of
    a pool (the pools are donated or only read)."""
    from sglang_tpu_backend.model_executor.step_compile import compile_dp_handover

    cfg = config_397b()
    mesh = make_mesh(8, topology_devices("tpu7x:2x2x1"))
    spec = StepSpec(ForwardMode.DECODE, 64, 64, 64, PAGES, 64 * PAGES, 256, 64)  # per rank
    report = compile_dp_handover(cfg, spec, mesh, install=install, kv_dtype=jnp.bfloat16,
                                 state_dtype=jnp.bfloat16)
    record(f"DP8 397B handover {'install' if install else 'export'} (64 pages)", report,
           min_kernels=0)
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        assert count(report.hlo, rf" {op}(?:-start)?\(") == 0, op
    la, lg = len(cfg.attention_layers), len(cfg.linear_layers)
    kv_page = 2 * cfg.num_key_value_heads * 256 * cfg.head_dim * 2  # bf16 bytes per page
    request = la * 64 * kv_page + lg * (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                        * cfg.linear_value_head_dim + 3 * cfg.linear_conv_dim) * 2
    pool = la * 64 * PAGES * kv_page  # one rank's KV pages
    mem = report.memory
    assert mem["temp_size_in_bytes"] <= 2 * request < pool / 10, (mem, request, pool)
    if install:  # the cache is updated in place
        assert mem.get("alias_size_in_bytes", 0) >= pool, mem


@pytest.mark.parametrize("install", [True, False], ids=["install", "export"])
def test_397b_nextn_mtp_handover_programs_stay_rank_local(record, install):
    """The NEXTN handover's MTP KV install (decode) and export (prefill) programs of the same
    request over the DP8 MTP pools: no collective, scratch of the request's MTP pages, not
    of a pool, and the install updates the pool in place."""
    from sglang_tpu_backend.model_executor.step_compile import compile_dp_mtp_handover

    cfg = config_397b()
    mesh = make_mesh(8, topology_devices("tpu7x:2x2x1"))
    spec = StepSpec(ForwardMode.DECODE, 64, 64, 64, PAGES, 64 * PAGES, 256, 64)  # per rank
    report = compile_dp_mtp_handover(cfg, spec, mesh, install=install, kv_dtype=jnp.bfloat16)
    record(f"DP8 397B NEXTN MTP KV handover {'install' if install else 'export'} (64 pages)",
           report, min_kernels=0)
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        assert count(report.hlo, rf" {op}(?:-start)?\(") == 0, op
    kv_page = 2 * cfg.num_key_value_heads * 256 * cfg.head_dim * 2  # bf16 bytes per page
    request = cfg.mtp_num_hidden_layers * 64 * kv_page
    pool = cfg.mtp_num_hidden_layers * 64 * PAGES * kv_page  # one rank's MTP pages
    mem = report.memory
    assert mem["temp_size_in_bytes"] <= 2 * request < pool / 10, (mem, request, pool)
    if install:
        assert mem.get("alias_size_in_bytes", 0) >= pool, mem


def collective_windows(hlo: str, op: str) -> list[tuple[tuple, list]]:
    """Each async ``op`` (``call-start`` of a computation rooted at ``op`` ... its
    ``call-done``) of the scheduled program: (its result dims, the TensorCore compute ops the
    schedule places between start and done: fusions, convolutions, Mosaic kernels)."""
    comps, _ = parse_module(hlo)
    windows = []
    for comp in comps.values():
        order = list(comp.instructions.values())
        at = {ins.name: k for k, ins in enumerate(order)}
        for done in order:
            start = comp.instructions.get(done.operands[0]) if done.opcode == "call-done" else None
            if start is None or start.opcode != "call-start":
                continue
            called = comps[start.called()["to_apply"]]
            if called.instructions[called.root].opcode != op:
                continue
            compute = [i for i in order[at[start.name] + 1:at[done.name]]
                       if i.opcode in ("fusion", "convolution")
                       or (i.opcode == "custom-call" and "tpu_custom_call" in i.attrs)]
            windows.append((done.arrays[0].dims, compute))
    return windows


def test_397b_hidden_all_gather_overlaps_compute():
    """In the scheduled 397B decode step each MoE layer's all-gather of the EP group's hidden
    rows runs asynchronously (on the SparseCore) while the TensorCore computes: the schedule
    places compute between its start and done, the routing computation among it."""
    cfg = config_397b()
    windows = collective_windows(compile_397b("tpu7x:2x2x1", 8, ForwardMode.DECODE, 64).hlo,
                                 "all-gather")
    hidden = [c for dims, c in windows if dims == (8 * 64, cfg.hidden_size)]
    print("\ncompute ops inside each async all-gather (result dims: ops):",
          [(dims, len(c)) for dims, c in windows])
    assert len(hidden) == cfg.layer_period, windows  # one per MoE layer of the scan body
    for ops in hidden:
        assert len(ops) >= 4, [i.name for i in ops]
        assert any("routed_experts" in i.op_name for i in ops), [i.op_name for i in ops]
