"""Per-device memory plan of one serving host: weights, KV pages, GDN state, activations.

    python -m sglang_tpu_backend.plan --model-config CONFIG --topology tpu7x:2x2x1 \\
        --dp 8 --ep 8 --context-length 9216 [--tp 8] [--expert-dtype fp8] [--json]

One device is one JAX device (one TensorCore). All sizes are bytes per device unless named
otherwise; the table prints GiB (2**30 B). Letters: H hidden, V vocab, E experts, k top-k,
I expert width, N/G q/kv heads of size D, Hk/Hv GDN key/value heads of size Dk/Dv,
C = 2*Hk*Dk + Hv*Dv conv channels, K conv taps, La/Lg attention/GDN layers.

Parallelism: dp x tp = devices of the topology. dp attention groups each own whole requests
(their KV pages and GDN state); inside a group of tp devices (tensor-parallel attention, as
SGLang's --tp-size) q heads, GDN key and value heads split over tp, and kv heads split too
when tp <= G, else each device holds one replicated kv head: g = max(1, G/tp),
hk = max(1, Hk/tp), hv = Hv/tp. Routed experts split over ep (E/ep per device, default ep =
devices); with EPLB's ``--ep-num-redundant-experts X`` the E + X physical expert slots split
over ep ((E+X)/ep per device) and each MoE layer's expert map is replicated. R is the number
of running requests per host; a device serves the requests of its group,
r = ceil(R * hosts / dp) (DP8: R/8; TP8: R).

weights   from ``models.param_shapes.param_shapes`` (+ ``num_param_bytes``), no shapes here:
          sharded    = routed experts / ep (FP8: 1 B/elem + f32 128x128 block scales)
                       + in TP mode q_proj, o_proj * 1/tp, k_proj, v_proj * g/G,
                         in_proj_qkv, conv1d * (2*hk*Dk + hv*Dv)/C, the other value-head
                         weights (in_proj_z/a/b, A_log, dt_bias, out_proj) * hv/Hv;
          replicated = the rest: embeddings, lm_head, norms, attention and GDN (DP mode),
                       router, shared expert, dense MLPs (also replicated in TP mode,
                       where SGLang shards vocab and shared expert: TP weights are an upper bound).
KV pages  r * ceil(context / page) * La * (2 * g * page * D * b_kv)      ([.., 2g, page, D])
GDN state r * Lg * (rows(K) * c * b_kv + hv * Dk * Dv * b_state)
          with rows = gdn_common.conv_state_rows(K) (4 for K = 4), c = 2*hk*Dk + hv*Dv;
          the conv state is stored in the KV dtype.
activations, one step of T = --max-num-batched-tokens tokens per DP rank, b = --dtype bytes:
          b * (2*T*H             residual stream + one layer's output
               + Tg*H            MoE all-gather of the EP group's tokens, Tg = max(1, ep/tp)*T
                                 (= dp*T when ep = devices)
               + M*(2*H + I))    routed rows: gathered-in and expert-out [M, H], SwiGLU [M, I],
                                 M = Tg*k (the static row count the MoE kernels allocate)
          + 4 * r * V            f32 logits for the device's running requests
MTP       with ``--mtp`` (NEXTN drafting) also the ``mtp.*`` layers: their weights (fc, norms, one
          full-attention MoE layer each, split like the main layers') and their KV pages (one
          more attention layer per MTP layer in La).
verify    with ``--speculative-num-draft-tokens n`` (n > 1: each decode step verifies n rows per
          request) the step holds, per request, what the commit needs to redo the accepted
          positions of every GDN layer (``model_executor/verify.VerifyStates``): the conv
          window and the gate inputs, r * Lg * ((K-1+n) * c * conv bytes + 2 * n * hv * b),
          no per-position recurrent state; its f32 logits grow to 4 * r * n * V.
headroom  = HBM per device - (weights + KV + GDN + activations); max_running_requests is the
          largest R with headroom >= 0 (binary search; the plan is monotone in R).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

from typing import Any

import jax

from sglang_tpu_backend.config import ModelConfig, load_model_config, model_config_from_dict
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows
from sglang_tpu_backend.models.param_shapes import mtp_param_shapes, num_param_bytes, param_shapes

GiB = 1 << 30
DEFAULT_CONFIG = (Path(__file__).resolve().parents[1] / "assets" / "configs"
                  / "qwen3.5-397b-a17b.json")
DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
DTYPE_FLAGS = {"--expert-dtype": ("fp8", "bf16"), "--dtype": ("bf16",),  # first: the default
               "--kv-dtype": ("bf16", "fp8"), "--state-dtype": ("bf16", "fp32")}


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: per-chip numbers; a JAX device is one TensorCore."""

    cores_per_chip: int
    hbm_per_chip: int  # bytes
    hbm_bw_per_chip: float  # bytes/s
    bf16_flops_per_chip: float
    fp8_flops_per_chip: float
    vmem_per_core: int  # bytes
    chips_per_host: int
    reserved_per_core: int = 0  # HBM bytes XLA keeps for itself: a program gets the rest


GENERATIONS = {  # Ironwood: 192 GiB HBM, 7.4 TB/s, 2,307 / 4,614 TFLOP/s per chip; XLA:TPU
    # offers a program 94.75 GiB of a TensorCore's 96 (its out-of-memory message says so).
    "tpu7x": Generation(cores_per_chip=2, hbm_per_chip=192 * GiB, hbm_bw_per_chip=7.4e12,
                        bf16_flops_per_chip=2307e12, fp8_flops_per_chip=4614e12,
                        vmem_per_core=64 << 20, chips_per_host=4,
                        reserved_per_core=5 * GiB // 4),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # e.g. "tpu7x:2x2x1"
    generation: Generation
    chips: int
    devices: int  # chips * cores_per_chip
    hosts: int
    hbm_per_device: int  # bytes a program may use (HBM per core less what XLA reserves)


def parse_topology(name: str) -> Topology:
    """``<generation>:AxBxC`` (chips along each axis) -> Topology; ValueError naming --topology."""
    m = re.fullmatch(r"([a-z0-9]+):(\d+)x(\d+)x(\d+)", name or "")
    if m is None or m.group(1) not in GENERATIONS:
        raise ValueError(f"--topology {name!r}: unknown topology; expected <generation>:AxBxC "
                         f"with generation one of {', '.join(GENERATIONS)} (e.g. tpu7x:2x2x1)")
    gen = GENERATIONS[m.group(1)]
    chips = math.prod(int(m.group(i)) for i in (2, 3, 4))
    if chips < 1 or (chips > gen.chips_per_host and chips % gen.chips_per_host):
        raise ValueError(f"--topology {name!r}: {chips} chips do not fill whole hosts of "
                         f"{gen.chips_per_host} chips")
    return Topology(name, gen, chips, devices=chips * gen.cores_per_chip,
                    hosts=max(1, chips // gen.chips_per_host),
                    hbm_per_device=gen.hbm_per_chip // gen.cores_per_chip
                    - gen.reserved_per_core)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for ``running_requests`` per host, and the largest R that fits."""

    topology: str
    devices: int
    hosts: int
    dp: int
    ep: int
    tp: int
    context_length: int
    page_size: int
    running_requests: int  # R, per host
    requests_per_device: int  # r = ceil(R * hosts / dp)
    weights_replicated: int
    weights_sharded: int
    kv_pages: int
    gdn_state: int
    activations: int
    hbm: int
    max_running_requests: int  # per host
    redundant_experts: int = 0  # EPLB: physical expert slots per MoE layer beyond E
    expert_slots_per_device: int = 0  # (E + redundant) / ep
    mtp_layers: int = 0  # MTP layers planned (weights and KV pages), 0 without --mtp
    num_draft_tokens: int = 1  # n rows verified per request and step (1: no speculation)

    @property
    def weights(self) -> int:
        return self.weights_replicated + self.weights_sharded

    @property
    def total(self) -> int:
        return self.weights + self.kv_pages + self.gdn_state + self.activations

    @property
    def headroom(self) -> int:
        return self.hbm - self.total

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "weights": self.weights, "total": self.total,
                "headroom": self.headroom}


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _heads_per_device(heads: int, tp: int, what: str) -> int:
    """Heads of one device: heads/tp, or 1 (replicated) when tp > heads."""
    _check(heads % tp == 0 or tp % heads == 0,
           f"--tp {tp} must divide or be a multiple of {what} ({heads})")
    return max(1, heads // tp)


def _tp_heads(cfg: ModelConfig, tp: int) -> tuple[int, int, int, int]:
    """(g, hk, hv, c) of one device: kv heads, GDN key / value heads, conv channels."""
    g = _heads_per_device(cfg.num_key_value_heads, tp, "num_key_value_heads")
    hk = _heads_per_device(cfg.linear_num_key_heads, tp, "linear_num_key_heads")
    hv = cfg.linear_num_value_heads // tp
    return g, hk, hv, 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim


def weight_bytes(cfg: ModelConfig, *, ep: int, tp: int, expert_dtype: str = "fp8",
                 dtype: Any = None, redundant_experts: int = 0, mtp: bool = False
                 ) -> tuple[int, int]:
    """(replicated, sharded) weight bytes per device, ``dtype`` (default bf16) but for FP8
    routed experts (``expert_dtype`` "fp8"); ``redundant_experts`` extra expert slots per
    MoE layer (EPLB) and their maps; ``mtp``: the MTP layers' weights too."""
    dtype = jax.numpy.bfloat16 if dtype is None else dtype
    slots = cfg.num_experts + redundant_experts if redundant_experts else None
    fp8 = expert_dtype == "fp8"
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8, num_physical_experts=slots)
    if mtp:
        _check(cfg.mtp_num_hidden_layers > 0, "--mtp: the config lists no MTP layer "
                                              "(mtp_num_hidden_layers)")
        shapes = (shapes, mtp_param_shapes(cfg, dtype, fp8_experts=fp8))
    g, _, hv, conv_dev = _tp_heads(cfg, tp)
    tp_split = {  # (module, leaf) -> (numerator, denominator) of the leaf one device holds
        ("self_attn", "q_proj"): (1, tp), ("self_attn", "o_proj"): (1, tp),
        ("self_attn", "k_proj"): (g, cfg.num_key_value_heads),
        ("self_attn", "v_proj"): (g, cfg.num_key_value_heads),
        ("linear_attn", "in_proj_qkv"): (conv_dev, cfg.linear_conv_dim),
        ("linear_attn", "conv1d"): (conv_dev, cfg.linear_conv_dim),
        **{("linear_attn", k): (hv, cfg.linear_num_value_heads)
           for k in ("in_proj_z", "in_proj_a", "in_proj_b", "A_log", "dt_bias", "out_proj")},
    }
    replicated = sharded = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        keys = [getattr(p, "key", None) for p in path]
        nbytes = num_param_bytes(leaf)
        if "experts" in keys:
            sharded += nbytes // ep
        elif tp > 1 and tuple(keys[-2:]) in tp_split:
            num, den = tp_split[tuple(keys[-2:])]
            _check(nbytes * num % den == 0, f"--tp {tp} does not split {'.'.join(keys[-2:])}")
            sharded += nbytes * num // den
        else:
            replicated += nbytes
    return replicated, sharded


def kv_page_bytes(cfg: ModelConfig, *, tp: int, page_size: int, kv_bytes: int,
                  mtp: bool = False, kv_scales: bool = False) -> int:
    """One KV page (``page_size`` tokens) of every attention layer (and with ``mtp`` every
    MTP layer), bytes per device; with ``kv_scales`` (an FP8 cache) plus one f32 scale per
    K/V row."""
    g = _tp_heads(cfg, tp)[0]
    layers = len(cfg.attention_layers) + (cfg.mtp_num_hidden_layers if mtp else 0)
    row = cfg.head_dim * kv_bytes + (4 if kv_scales else 0)
    return layers * 2 * g * page_size * row


def gdn_slot_bytes(cfg: ModelConfig, *, tp: int, conv_bytes: int, state_bytes: int) -> int:
    """One request's GDN state (conv state of ``conv_bytes`` per element: the KV dtype's, or
    the state dtype's beside an FP8 KV cache, see ``qwen3_5_moe.init_cache``; + recurrent
    state) of every GDN layer, bytes per device."""
    _, _, hv, c = _tp_heads(cfg, tp)
    return len(cfg.linear_layers) * (
        conv_state_rows(cfg.linear_conv_kernel_dim) * c * conv_bytes
        + hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes)


def verify_state_bytes(cfg: ModelConfig, *, tp: int, num_draft_tokens: int, conv_bytes: int,
                       gate_bytes: int) -> int:
    """One request's ``VerifyStates`` in a verify step of n = ``num_draft_tokens`` rows: every
    GDN layer's conv window (the slot's K-1 rows, then the n inputs; ``conv_bytes`` each) and
    its n positions' gate inputs a, b [n, Hv] (``gate_bytes``, the activation dtype's), bytes
    per device. No recurrent state per position: the commit recomputes the accepted positions
    from the slot (``kernels/gdn_verify.py``)."""
    _, _, hv, c = _tp_heads(cfg, tp)
    n = num_draft_tokens
    return len(cfg.linear_layers) * (
        (cfg.linear_conv_kernel_dim - 1 + n) * c * conv_bytes + 2 * n * hv * gate_bytes)


def step_activation_bytes(cfg: ModelConfig, *, ep: int, tp: int, tokens: int,
                          dtype_bytes: int) -> int:
    """Activations of one step of ``tokens`` token rows per DP rank, bytes per device, without
    the logits (4 * requests * V, added by the caller)."""
    T, H = tokens, cfg.hidden_size
    Tg = max(1, ep // tp) * T
    M = Tg * cfg.num_experts_per_tok
    return dtype_bytes * (2 * T * H + Tg * H + M * (2 * H + cfg.moe_intermediate_size))


def plan(cfg: ModelConfig, topology: str | Topology = "tpu7x:2x2x1", *, dp: int | None = None,
         ep: int | None = None, tp: int | None = None, running_requests: int | None = None,
         context_length: int = 9216, page_size: int = 256, expert_dtype: str = "fp8",
         dtype: str = "bf16", kv_dtype: str = "bf16", state_dtype: str = "bf16",
         max_num_batched_tokens: int = 1024, redundant_experts: int = 0,
         mtp: bool = False, num_draft_tokens: int = 1) -> MemoryPlan:
    """Memory per device for ``running_requests`` per host (default: the most that fit).

    dp and tp default to fill the topology (dp = devices / tp, tp = devices / dp; both unset:
    dp = devices, tp = 1); ep defaults to the device count. Raises ValueError naming the flag.
    """
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    n = topo.devices
    for (flag, choices), val in zip(DTYPE_FLAGS.items(),
                                   (expert_dtype, dtype, kv_dtype, state_dtype)):
        _check(val in choices, f"{flag} {val!r}: expected one of {', '.join(choices)}")
    for flag, val in (("--dp", dp), ("--ep", ep), ("--tp", tp), ("--context-length", context_length),
                      ("--page-size", page_size), ("--speculative-num-draft-tokens", num_draft_tokens),
                      ("--max-num-batched-tokens", max_num_batched_tokens)):
        _check(val is None or val >= 1, f"{flag} {val} must be >= 1")
    tp = tp or (n // dp if dp else 1)
    dp = dp or max(1, n // tp)
    ep = ep or n
    mtp_layers = cfg.mtp_num_hidden_layers if mtp else 0
    _check(dp * tp == n, f"--dp {dp} x --tp {tp} = {dp * tp} must equal the {n} devices "
                         f"of --topology {topo.name}")
    _check(n % ep == 0, f"--ep {ep} must divide the {n} devices of --topology {topo.name}")
    _check(cfg.num_experts % ep == 0,
           f"--ep {ep} does not divide num_experts ({cfg.num_experts})")
    _check(redundant_experts >= 0 and (cfg.num_experts + redundant_experts) % ep == 0,
           f"--ep-num-redundant-experts {redundant_experts}: num_experts ({cfg.num_experts}) "
           f"plus it must be a non-negative multiple of --ep {ep}")
    _check(cfg.num_attention_heads % tp == 0 and cfg.linear_num_value_heads % tp == 0,
           f"--tp {tp} must divide num_attention_heads ({cfg.num_attention_heads}) and "
           f"linear_num_value_heads ({cfg.linear_num_value_heads})")
    replicated, sharded = weight_bytes(cfg, ep=ep, tp=tp, expert_dtype=expert_dtype,
                                       redundant_experts=redundant_experts, mtp=mtp)

    b_kv, b_state, b = DTYPE_BYTES[kv_dtype], DTYPE_BYTES[state_dtype], DTYPE_BYTES[dtype]
    fp8_kv = kv_dtype == "fp8"  # float8_e4m3fn pages + f32 scales; conv state in state_dtype
    kv_per_req = (-(-context_length // page_size)) * kv_page_bytes(
        cfg, tp=tp, page_size=page_size, kv_bytes=b_kv, mtp=mtp, kv_scales=fp8_kv)
    gdn_per_req = gdn_slot_bytes(cfg, tp=tp, conv_bytes=b_state if fp8_kv else b_kv,
                                 state_bytes=b_state)
    act_fixed = step_activation_bytes(cfg, ep=ep, tp=tp, tokens=max_num_batched_tokens,
                                      dtype_bytes=b)
    nd = num_draft_tokens
    act_per_req = 4 * nd * cfg.vocab_size + (verify_state_bytes(
        cfg, tp=tp, num_draft_tokens=nd, conv_bytes=b_state if fp8_kv else b_kv,
        gate_bytes=b) if nd > 1 else 0)

    def per_device(R: int) -> tuple[int, int, int, int]:
        r = -(-R * topo.hosts // dp)
        return r, r * kv_per_req, r * gdn_per_req, act_fixed + r * act_per_req

    hbm = topo.hbm_per_device
    fits = lambda R: replicated + sharded + sum(per_device(R)[1:]) <= hbm  # noqa: E731
    lo, hi = 0, 1  # largest R with fits(R): lo fits (or is 0), hi does not
    while fits(hi) and hi < 1 << 30:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    max_r = lo if fits(lo) else 0
    R = max_r if running_requests is None else running_requests
    _check(R >= 0, f"--max-running-requests {R} must be >= 0")
    r, kv, gdn, act = per_device(R)
    return MemoryPlan(topology=topo.name, devices=n, hosts=topo.hosts, dp=dp, ep=ep, tp=tp,
                      context_length=context_length, page_size=page_size, running_requests=R,
                      requests_per_device=r, weights_replicated=replicated,
                      weights_sharded=sharded, kv_pages=kv, gdn_state=gdn, activations=act,
                      hbm=hbm, max_running_requests=max_r, redundant_experts=redundant_experts,
                      expert_slots_per_device=(cfg.num_experts + redundant_experts) // ep,
                      mtp_layers=mtp_layers, num_draft_tokens=nd)


def format_plan(p: MemoryPlan) -> str:
    """A readable table, GiB per device."""
    mode = "+".join([f"DP{p.dp}"] * (p.dp > 1) + [f"TP{p.tp}"] * (p.tp > 1) + [f"EP{p.ep}"])
    head = (f"{p.topology}: {p.devices} devices on {p.hosts} host(s), {mode}, context "
            f"{p.context_length} tokens, page {p.page_size}, "
            f"{p.expert_slots_per_device} expert slots per device per MoE layer "
            f"({p.redundant_experts} redundant), {p.mtp_layers} MTP layer(s), "
            f"{p.num_draft_tokens} row(s) verified per request and step\n"
            f"running requests per host {p.running_requests} "
            f"({p.requests_per_device} per DP rank, held on each of its {p.tp} device(s))\n")
    rows = [("weights, replicated", p.weights_replicated), ("weights, sharded", p.weights_sharded),
            ("KV pages", p.kv_pages), ("GDN state", p.gdn_state),
            ("activations", p.activations), ("total", p.total), ("HBM", p.hbm),
            ("headroom", p.headroom)]
    body = "\n".join(f"  {name:<22}{v / GiB:>9.2f} GiB" for name, v in rows)
    return (head + body + f"\nmax running requests per host: {p.max_running_requests} "
            f"({-(-p.max_running_requests * p.hosts // p.dp)} per DP rank)")


def _load(path: str) -> ModelConfig:
    try:
        if Path(path).is_dir():
            return load_model_config(path)
        return model_config_from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:  # ConfigError and JSONDecodeError are ValueErrors
        raise ValueError(f"--model-config {path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_backend.plan",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default=str(DEFAULT_CONFIG),
                    help="config.json or a checkpoint directory (default: Qwen3.5-397B-A17B)")
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--dp", type=int, help="DP attention ranks (default: devices / tp)")
    ap.add_argument("--ep", type=int, help="expert-parallel ranks (default: devices)")
    ap.add_argument("--tp", type=int, help="tensor-parallel attention width (default 1)")
    ap.add_argument("--max-running-requests", type=int,
                    help="running requests per host (default: the most that fit)")
    ap.add_argument("--context-length", "--context-len", dest="context_length", type=int, default=9216,
                    help="tokens of one request (the server's --context-length; --context-len "
                         "is accepted too)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--ep-num-redundant-experts", type=int, default=0,
                    help="EPLB's redundant expert slots per MoE layer (the server's flag)")
    for flag, choices in DTYPE_FLAGS.items():
        ap.add_argument(flag, default=choices[0], choices=choices)
    ap.add_argument("--mtp", action="store_true",
                    help="also hold the MTP layers' weights and KV pages (NEXTN drafting)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=1,
                    help="rows verified per request and decode step (the last token and its "
                         "drafts; 1: no speculation): the verify step's GDN inputs and logits")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"),
                    help="the server's flag: fp8_e4m3 is --kv-dtype fp8 (float8_e4m3fn pages "
                         "with f32 per-row scales), auto leaves --kv-dtype")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--compile", action="store_true",
                    help="also compile the DP x EP step for the topology with libtpu and print "
                         "the compiler's memory_analysis() and cost_analysis() per device")
    ap.add_argument("--layers", type=int,
                    help="with --compile: plan and compile only the first N layers")
    a = ap.parse_args(argv)
    if a.kv_cache_dtype == "fp8_e4m3":
        a.kv_dtype = "fp8"
    try:
        cfg = _load(a.model_config)
        if a.layers:
            cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers,
                                      layer_types=cfg.layer_types[:a.layers])
        p = plan(cfg, a.topology, dp=a.dp, ep=a.ep, tp=a.tp,
                 running_requests=a.max_running_requests, context_length=a.context_length,
                 page_size=a.page_size, expert_dtype=a.expert_dtype, dtype=a.dtype,
                 kv_dtype=a.kv_dtype, state_dtype=a.state_dtype,
                 max_num_batched_tokens=a.max_num_batched_tokens,
                 redundant_experts=a.ep_num_redundant_experts, mtp=a.mtp,
                 num_draft_tokens=a.speculative_num_draft_tokens)
    except ValueError as e:  # ConfigError is a ValueError
        ap.error(str(e))
    if not a.compile:
        print(json.dumps(p.to_dict(), indent=2) if a.json else format_plan(p))
        return 0
    if p.tp != 1 and p.tp != p.devices:
        ap.error("--compile: the DP x EP step (--tp 1) or tensor-parallel attention over "
                 f"all {p.devices} devices (--tp {p.devices}) is compiled")
    if not a.json:
        print(format_plan(p))
    # With --json the compile's tables go to stderr and the JSON (plan + efficiency) last.
    rc, efficiency = compile_and_compare(cfg, p, a, out=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps({**p.to_dict(), "program_efficiency": efficiency}, indent=2))
    return rc


def compile_and_compare(cfg: ModelConfig, p: MemoryPlan, a, out=sys.stdout
                        ) -> tuple[int, dict[str, float]]:
    """Compile the decode step of the plan (``r`` requests per DP rank, or all of them in
    tensor-parallel mode) and print the compiler's figures per device beside the planner's
    estimate; for the DP x EP step also the program efficiency (``program_roofline.py``) of
    that decode step and of a prefill step of ``--max-num-batched-tokens`` tokens per rank.
    Returns (exit code, {"decode": bytes efficiency, "prefill": FLOPs efficiency})."""
    import jax.numpy as jnp

    from sglang_tpu_backend.kernels.tpu_compile import topology_devices
    from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
    from sglang_tpu_backend.model_executor.step_compile import (
        StepSpec,
        compile_dp_step,
        compile_tp_step,
    )
    from sglang_tpu_backend.parallel.mesh import make_mesh

    jdt = {"fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16, "fp32": jnp.float32}
    r = p.requests_per_device
    pages = -(-p.context_length // p.page_size)
    spec = StepSpec(ForwardMode.DECODE, r, r, r, pages, r * pages, p.page_size, r)
    mesh = make_mesh(p.devices, topology_devices(p.topology))
    step = compile_dp_step if p.tp == 1 else compile_tp_step
    kw = dict(fp8_experts=a.expert_dtype == "fp8", kv_dtype=jdt[a.kv_dtype],
              state_dtype=jdt[a.state_dtype])
    try:
        extra = {"redundant_experts": p.redundant_experts} if p.redundant_experts else {}
        rep = step(cfg, spec, mesh, **kw, **extra)
    except Exception as e:  # XLA:TPU refuses programs that do not fit: report, do not crash
        print(f"compile failed: {str(e).splitlines()[0]}", file=out)
        return 1, {}
    gib = 2.0**30
    used = rep.memory["argument_size_in_bytes"] + rep.memory["temp_size_in_bytes"]
    who = "per DP rank" if p.tp == 1 else f"on each of {p.tp} tensor-parallel devices"
    print(f"compiled decode step, {r} requests {who}: {rep.seconds:.1f} s", file=out)
    print(f"  compiler per device: arguments {rep.memory['argument_size_in_bytes'] / gib:.2f} GiB"
          f" + temp {rep.memory['temp_size_in_bytes'] / gib:.2f} GiB = {used / gib:.2f} GiB",
          file=out)
    print(f"  planner per device:  {p.total / gib:.2f} GiB "
          f"(compiler / planner = {used / p.total:.3f}); HBM {p.hbm / gib:.2f} GiB", file=out)
    c = rep.cost
    est = c.get("optimal_seconds", -1.0)  # XLA reports a negative time when it cannot estimate
    est = f"{est * 1e3:.2f} ms per step" if est > 0 else "n/a (custom calls)"
    print(f"  cost_analysis: {c.get('flops', 0) / 1e12:.3f} TFLOP, "
          f"{c.get('bytes accessed', 0) / 1e9:.2f} GB accessed, XLA time estimate {est}",
          file=out)
    if p.tp != 1 or r < 1:
        return 0, {}
    T = a.max_num_batched_tokens
    seqs = min(r, T)  # the prefill bucket: T tokens over (up to) the rank's requests
    prefill = StepSpec(ForwardMode.EXTEND, T, seqs, seqs, pages, r * pages, p.page_size, r)
    try:
        hlo = {"decode": (rep.hlo, r, r), "prefill": (compile_dp_step(
            cfg, prefill, mesh, **kw, **extra).hlo, T, seqs)}
    except Exception as e:
        print(f"prefill compile failed: {str(e).splitlines()[0]}", file=out)
        return 1, {}
    return 0, print_program_efficiency(cfg, p, a, hlo, out)


def print_program_efficiency(cfg: ModelConfig, p: MemoryPlan, a, hlo: dict, out
                             ) -> dict[str, float]:
    """Charge each bucket's compiled HLO (``{name: (hlo, tokens, requests) per rank}``), print
    its per-kind table and return each bucket's efficiency."""
    from sglang_tpu_backend.planning.compiled_roofline import Device
    from sglang_tpu_backend.planning.program_roofline import bucket_efficiency, format_efficiency
    from sglang_tpu_backend.planning.roofline import Hardware

    gen = parse_topology(p.topology).generation
    hw = Hardware(p.topology, gen.bf16_flops_per_chip, gen.fp8_flops_per_chip,
                  gen.hbm_bw_per_chip, gen.hbm_per_chip, gen.cores_per_chip)
    device = Device.of(hw, p.devices)
    kv_len = -(-p.context_length // p.page_size) * p.page_size  # full page rows, as compiled
    names = {"fp32": "f32"}
    result = {}
    for name, (text, tokens, seqs) in hlo.items():
        b = bucket_efficiency(name, text, cfg, tokens=tokens, seqs=seqs, kv_len=kv_len,
                              devices=p.devices, device=device, expert_dtype=a.expert_dtype,
                              state_dtype=names.get(a.state_dtype, a.state_dtype),
                              kv_dtype=names.get(a.kv_dtype, a.kv_dtype))
        print(f"program roofline, {name} step ({tokens} tokens per DP rank), per device:\n"
              + format_efficiency(b), file=out)
        result[name] = round(b.efficiency, 4)
    return result


if __name__ == "__main__":
    sys.exit(main())
