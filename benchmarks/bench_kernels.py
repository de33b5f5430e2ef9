"""Every Pallas kernel of the project against the chip's roofline, beside JAX's bundled Pallas
TPU kernels or plain XLA at the same shapes (issue 36).

On a TPU (one chip; Qwen3.5-397B per-chip shapes, or the embedded tiny model's):

    python benchmarks/bench_kernels.py --preset 397b --json-out out.json --markdown-out out.md
    python benchmarks/bench_kernels.py --preset tiny --only gmm
    python benchmarks/bench_kernels.py --list

On the CPU (smoke shapes, kernels in TPU interpret mode; times mean nothing):

    JAX_PLATFORMS=cpu python benchmarks/bench_kernels.py --preset smoke --interpret --iters 2

Without a TPU, ``--compile-only v5e:2x2`` lowers and compiles each of our cases for that
topology with libtpu (``kernels/tpu_compile.py``) and prints OK or the error, the
memory_analysis() and the Mosaic kernels' VMEM; nothing runs.

Each case is timed by :func:`time_call`: one jitted call on fixed inputs, ``--warmup`` calls
(the first compiles), then three runs of ``--iters`` calls dispatched back to back and waited
for once, less one call waited for alone (``device_timing.py``): the device's time per call,
without the host's wait to learn that a call finished (0.6-1.1 ms more per call on a v5e host;
runs before 2026-12-07
timed calls waited for one by one, that round trip included; it is kept as ``waited_ms``).
Median and min in ms (an implementation that would take over ``--budget-s`` gets fewer
calls). Inputs
that a kernel updates in place (the K/V write's cache, GDN's states) are donated and the
output fed back as the next input, so no call copies them.

Columns: ours ms (median), GB/s = bytes / time, TFLOP/s = flops / time, % roofline =
roofline_ms / time_ms with roofline_ms = max(bytes / HBM bandwidth, flops / peak) from
``roofline.hardware_for(device_kind)`` (on the CPU n/a, or ``--measure-cpu``), then each peer
(name, ms, % roofline, speed-up = peer_ms / ours_ms). ``bytes`` is the minimum HBM traffic
(weights / KV / state read once, activations in and out once) and ``flops`` the useful
FLOPs (multiply-add = 2); each case's formula is in its ``formula`` field. A peer that fails
to lower or run is recorded with ``error`` (its exception's first line), and the run goes on.
``max_abs_diff_vs_peer`` compares our output with the peer's (first call, rows that hold
results only).

Cases (``--list``): attention (decode at two contexts, FP8 KV, prefill, mixed, K/V write),
GMM (gate_up + SwiGLU and down, bf16 and FP8 weights, decode and prefill, prefill in the
model's gathered expert-parallel layout and packed), GDN (decode bf16 / f32 state, chunked
prefill), routing (gather, gather-reduce at decode and prefill rows), collectives (skipped:
they need a multi-device mesh). ``--gdn-rows 1,8`` adds the GDN decode cases at those decode
rows per grid step (``-rb1``, ``-rb8``) beside the default's:

    python benchmarks/bench_kernels.py --only gdn/decode --gdn-rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from sglang_tpu_backend.config import model_config_from_dict  # noqa: E402
from sglang_tpu_backend.kernels import dispatch, gdn, gdn_geometry, gmm, routing  # noqa: E402
from sglang_tpu_backend.kernels import ragged_paged_attention as rpa  # noqa: E402
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows  # noqa: E402
from sglang_tpu_backend.planning import roofline  # noqa: E402
from device_timing import device_ms, waited_ms  # noqa: E402

CONFIGS = ROOT / "sglang_tpu_backend" / "assets"
CONFIG_397B = CONFIGS / "configs" / "qwen3.5-397b-a17b.json"
CONFIG_TINY = CONFIGS / "tiny-qwen3.5-moe" / "config.json"
BF16 = jnp.bfloat16


# ----------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class Preset:
    """Shapes of one run. Attention: Hq / Hkv heads of dim D, ``page`` tokens per page,
    ``decode_reqs`` requests at each of ``decode_ctx`` contexts, ``prefill_reqs`` x
    ``prefill_new`` new tokens on ``prefill_cached``; mixed: ``mixed_decode`` decode rows at
    decode_ctx[0] plus one prefill chunk. GDN: ``gdn_hk`` / ``gdn_hv`` heads of dim
    ``gdn_d``, conv ``conv_k`` taps. MoE: ``hidden``, ``experts`` in all, ``devices`` EP
    ranks (local experts = experts / devices), ``top_k``, expert width ``inter``; decode
    gathers ``moe_decode_tokens`` tokens of all ranks, prefill ``moe_prefill_tokens``."""

    name: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page: int
    decode_reqs: int
    decode_ctx: tuple[int, int]
    prefill_reqs: int
    prefill_new: int
    prefill_cached: int
    mixed_decode: int
    gdn_hk: int
    gdn_hv: int
    gdn_d: int
    conv_k: int
    experts: int
    devices: int
    top_k: int
    inter: int
    moe_decode_tokens: int
    moe_prefill_tokens: int

    @property
    def local_experts(self) -> int:
        return self.experts // self.devices


def _from_config(name, path, *, page, devices, decode_ctx=(2048, 8192)):
    """A preset with a config.json's model shapes and the issue's batch shapes."""
    c = model_config_from_dict(json.loads(Path(path).read_text()))
    return Preset(
        name=name, hidden=c.hidden_size, q_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads, head_dim=c.head_dim, page=page, decode_reqs=64,
        decode_ctx=decode_ctx, prefill_reqs=4, prefill_new=1024, prefill_cached=1024,
        mixed_decode=32, gdn_hk=c.linear_num_key_heads, gdn_hv=c.linear_num_value_heads,
        gdn_d=c.linear_key_head_dim, conv_k=c.linear_conv_kernel_dim, experts=c.num_experts,
        devices=devices, top_k=c.num_experts_per_tok, inter=c.moe_intermediate_size,
        # decode: 64 requests on each of the EP ranks, gathered; prefill: 8,192 tokens.
        moe_decode_tokens=64 * devices, moe_prefill_tokens=8192)


def preset(name: str) -> Preset:
    """``397b``: one of 8 chips of Qwen3.5-397B (64 of 512 experts, page 256); ``tiny``: the
    embedded default model on one device (page 16, the server's default); ``smoke``: CPU."""
    if name == "397b":
        return _from_config("397b", CONFIG_397B, page=256, devices=8)
    if name == "tiny":
        return _from_config("tiny", CONFIG_TINY, page=16, devices=1)
    if name == "smoke":
        return Preset(name="smoke", hidden=256, q_heads=4, kv_heads=2, head_dim=128, page=16,
                      decode_reqs=4, decode_ctx=(64, 128), prefill_reqs=2, prefill_new=32,
                      prefill_cached=32, mixed_decode=2, gdn_hk=2, gdn_hv=4, gdn_d=32,
                      conv_k=4, experts=16, devices=2, top_k=4, inter=128,
                      moe_decode_tokens=8, moe_prefill_tokens=64)
    raise ValueError(f"unknown preset {name!r} (397b, tiny, smoke)")


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Impl:
    """One implementation of a case: ``fn(*make_args())``; ``donate`` maps a donated argument
    to the output that replaces it on the next call; ``out`` picks the compared array."""

    name: str
    fn: Callable
    make_args: Callable[[], tuple]
    donate: dict[int, int] = dataclasses.field(default_factory=dict)
    out: Callable = lambda o: o
    note: str | None = None  # how the peer differs from ours (recorded in the JSON)


@dataclasses.dataclass
class Setup:
    """What a case builder returns: our kernel, its peers, the cost and the compared rows."""

    ours: Impl
    peers: list[Impl]
    bytes: int
    flops: int
    formula: str
    shapes: str
    valid_rows: int | None = None  # compare only the first rows of the outputs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[..., Setup]  # build(preset, impl, blocks) -> Setup
    skip: str | None = None  # a reason not to run it (shown, never an error)


def _key(i: int):
    return jax.random.PRNGKey(i)


def _normal(i, shape, dtype=BF16, scale=1.0):
    return (scale * jax.random.normal(_key(i), shape, jnp.float32)).astype(dtype)


def _interpret_peers(impl: str) -> bool:
    return impl == "interpret" and jax.default_backend() != "tpu"


# ---- attention


@dataclasses.dataclass(frozen=True)
class AttnBatch:
    """q_lens / kv_lens per request (kv_lens include the new tokens)."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


def attention_cost(p: Preset, batch: AttnBatch, kv_itemsize: int, scales: bool):
    """Bytes = q in + o out (bf16) + every request's K and V rows read once (kv_len rows of
    2*Hkv heads x D, + a f32 scale per row with an FP8 cache) + metadata (i32: kv_lens,
    page table, cu_q_lens, num_seqs, layer); FLOPs = 4 Hq D x (keys each query sees, causal).
    Equal to ``ragged_paged_attention_cost`` (an upper bound from shapes) for decode rows
    whose contexts fill their page-table rows; exact (causal, ragged) otherwise."""
    tokens = sum(batch.q_lens)
    row = p.head_dim * kv_itemsize + (4 if scales else 0)
    pages = max(-(-k // p.page) for k in batch.kv_lens)
    r = len(batch.q_lens)
    nbytes = (2 * tokens * p.q_heads * p.head_dim * 2 + sum(batch.kv_lens) * 2 * p.kv_heads * row
              + 4 * (r * (pages + 2) + 3))
    seen = sum(sum(k - q + i + 1 for i in range(q)) for q, k in zip(batch.q_lens, batch.kv_lens))
    return nbytes, 4 * p.q_heads * p.head_dim * seen


def _attn_meta(p: Preset, batch: AttnBatch):
    """i32 kv_lens [R], page table [R, P] (each request's pages consecutive), cu_q_lens
    [R + 1], num_seqs [1]."""
    pps = max(-(-k // p.page) for k in batch.kv_lens)
    r = len(batch.q_lens)
    return (jnp.asarray(batch.kv_lens, jnp.int32),
            jnp.arange(r * pps, dtype=jnp.int32).reshape(r, pps),
            jnp.asarray(np.concatenate([[0], np.cumsum(batch.q_lens)]), jnp.int32),
            jnp.asarray([r], jnp.int32))


def _attn_arrays(p: Preset, batch: AttnBatch, kv_dtype):
    """Our layout: q [T, Hq, D], kv_pages [1, N, 2*Hkv, S, D], scales f32[1, N, 2*Hkv, S]
    (None unless FP8); N = R * P pages."""
    n = len(batch.q_lens) * max(-(-k // p.page) for k in batch.kv_lens)
    q = _normal(1, (sum(batch.q_lens), p.q_heads, p.head_dim))
    kv = _normal(2, (1, n, 2 * p.kv_heads, p.page, p.head_dim), jnp.float32)
    if rpa.is_quantized(kv_dtype):
        kv, scales = rpa.quantize_rows(kv, kv_dtype)
        return q, kv, scales
    return q, kv.astype(kv_dtype), None


def _block(blocks: dict, key: str):
    return (blocks or {}).get(key) or {}


def attention_case(p: Preset, batch: AttnBatch, kv_dtype, impl: str, blocks: dict) -> Setup:
    meta = _attn_meta(p, batch)
    arrays = lambda: _attn_arrays(p, batch, kv_dtype)  # noqa: E731
    sm = p.head_dim ** -0.5
    fp8 = rpa.is_quantized(kv_dtype)
    tokens = sum(batch.q_lens)
    over = _block(blocks, "attention")
    bs = None
    if over:
        bs = dataclasses.replace(rpa.BlockSizes.get_default(
            tokens, p.q_heads // p.kv_heads, p.page, meta[1].shape[1]), **over)

    def ours(impl_):
        def fn(q, kv, sc, *m):
            return rpa.ragged_paged_attention(q, kv, *m, sm_scale=sm, impl=impl_,
                                              block_sizes=bs, kv_scales=sc)
        return fn

    args = lambda: (*arrays(), *meta)  # noqa: E731
    interp = _interpret_peers(impl)
    rpa_over = _block(blocks, "rpa")

    def bundled_rpa(q, kv, *m):
        # Bundled ragged_paged_attention: kv [N, S, 2*Hkv, D] (K, V interleaved as ours), one
        # layer; an FP8 cache takes one scale per tensor (1.0 here: the rows' own scales are
        # ours only, so the outputs differ by them).
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
        if fp8 and not interp and jax.devices()[0].device_kind == "TPU v5 lite":
            raise NotImplementedError("not run: on a v5e with an FP8 cache it had not returned "
                                      "when a 90 s limit on the whole run ended it")
        extra = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
        if interp:  # its tuned-size table asks the TPU's version: give the sizes off a TPU
            extra.update(num_kv_pages_per_block=min(rpa.KV_BLOCK_TOKENS // p.page,
                                                    meta[1].shape[1]),
                         num_queries_per_block=16)
        return _maybe_interpret(interp, ragged_paged_attention, q, kv, *m, sm_scale=sm,
                                **{**extra, **rpa_over})

    def rpa_args():
        q, kv, _ = arrays()
        return (q, jnp.transpose(kv[0], (0, 2, 1, 3)), *meta)

    peers = [Impl("jax-rpa", bundled_rpa, rpa_args, note=(
        "FP8 pages with one scale per tensor (1.0): the rows' own scales are ours only, so "
        "the outputs differ by them" if fp8 else None))]
    if all(x == 1 for x in batch.q_lens):  # bundled paged_attention: decode only
        peers.append(_paged_attention_peer(p, arrays, meta, interp, blocks, fp8))
    peers.append(Impl("ours-xla", ours("xla"), args))
    nbytes, flops = attention_cost(p, batch, jnp.dtype(kv_dtype).itemsize, fp8)
    pages = meta[1].size
    shapes = (f"q [{tokens}, {p.q_heads}, {p.head_dim}], kv [1, {pages}, {2 * p.kv_heads}, "
              f"{p.page}, {p.head_dim}] {jnp.dtype(kv_dtype).name}, {len(batch.q_lens)} requests")
    return Setup(Impl("ours", ours(impl), args), peers, nbytes, flops,
                 "2*T*Hq*D*2 + sum(kv_len)*2*Hkv*(D*kv_bytes [+4]) + 4*(R*(P+2)+3); "
                 "flops 4*Hq*D*sum(causal keys)", shapes)


def _paged_attention_peer(p, arrays, meta, interp, blocks, scales_fp8: bool):
    """Bundled paged_attention: q [B, Hq, D] (pre-scaled: it has no sm_scale), k / v pages
    [Hkv, N, S, D]; FP8 pages go in as its QuantizedTensor with scales * 127.5 (it
    dequantises as x * s / 127.5)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        MAX_INT8, QuantizedTensor)
    pps = meta[1].shape[1]
    ppb = _block(blocks, "paged_attention").get(
        "pages_per_compute_block", max(1, min(rpa.KV_BLOCK_TOKENS // p.page, pps)))
    while pps % ppb:
        ppb -= 1

    def make():
        q, kv, scales = arrays()
        k = jnp.transpose(kv[0, :, 0::2], (1, 0, 2, 3))  # [Hkv, N, S, D]
        v = jnp.transpose(kv[0, :, 1::2], (1, 0, 2, 3))
        if scales is not None:
            ks = jnp.transpose(scales[0, :, 0::2], (1, 0, 2))[..., None] * MAX_INT8
            vs = jnp.transpose(scales[0, :, 1::2], (1, 0, 2))[..., None] * MAX_INT8
            k, v = QuantizedTensor(k, ks), QuantizedTensor(v, vs)
        return q, k, v, meta[0], meta[1]

    def fn(q, k, v, lens, pages):
        qs = (q.astype(jnp.float32) * p.head_dim ** -0.5).astype(q.dtype)
        o = _maybe_interpret(interp, paged_attention, qs, k, v, lens, pages,
                             pages_per_compute_block=ppb)
        return o.astype(q.dtype)

    return Impl("jax-paged_attention", fn, make, note="q scaled by D^-0.5 in the jit" + (
        "; FP8 pages as its QuantizedTensor, scales broadcast to [Hkv, N, S, D] f32" if
        scales_fp8 else ""))


def _maybe_interpret(interp: bool, fn, *args, **kw):
    """Call a bundled kernel, in TPU interpret mode when running on the CPU."""
    if not interp:
        return fn(*args, **kw)
    from jax.experimental.pallas import tpu as pltpu
    with pltpu.force_tpu_interpret_mode():
        return fn(*args, **kw)


def kv_write_case(p: Preset, impl: str, blocks: dict) -> Setup:
    """The decode step's K/V write alone: one new row per request into a 2K-context cache."""
    r, ctx = p.decode_reqs, p.decode_ctx[0]
    batch = AttnBatch((1,) * r, (ctx,) * r)
    pps = -(-ctx // p.page)
    meta = (jnp.asarray(batch.kv_lens, jnp.int32),
            jnp.arange(r * pps, dtype=jnp.int32).reshape(r, pps),
            jnp.arange(r + 1, dtype=jnp.int32), jnp.asarray([r], jnp.int32))
    shape = (1, r * pps, 2 * p.kv_heads, p.page, p.head_dim)
    new = lambda i: _normal(i, (r, p.kv_heads, p.head_dim))  # noqa: E731
    make = lambda: (jnp.zeros(shape, BF16), new(3), new(4), *meta)  # noqa: E731
    resolved = dispatch.resolve(impl, has_xla=True)

    def ours(kv, k, v, *m):
        return rpa._pallas_write_new_kv(kv, k, v, jnp.int32(0), *m,
                                        interpret=dispatch.interpret_params(resolved))

    def xla(kv, k, v, *m):
        return rpa.write_new_kv(kv, k, v, *m)

    window = rpa.write_window_rows(BF16, p.page)
    nbytes = 2 * r * 2 * p.kv_heads * p.head_dim * 2 + 4 * (r * (pps + 2) + 3)
    return Setup(Impl("ours", ours, make, {0: 0}), [Impl("xla-scatter", xla, make, {0: 0})],
                 nbytes, 0, "new K,V in (R*2*Hkv*D*2) + the same rows written + metadata "
                 f"(the kernel moves whole {window}-row windows: read + write)",
                 f"{r} rows into kv {list(shape)} bf16")


# ---- GMM


def moe_draw(p: Preset, tokens: int, seed: int):
    """A seeded top-k draw of ``tokens`` gathered tokens over all experts (mildly skewed
    logits, so the groups are uneven), seen from the EP rank whose local row count is closest
    to the balanced tokens * K / devices. Returns route_metadata's (token_idx i32[T*K],
    group_sizes i32[E_local], rows i32[T, K]) for that rank and its local row count."""
    k1, k2 = jax.random.split(_key(seed))
    bias = 0.5 * jax.random.normal(k1, (p.experts,))
    top = jax.lax.top_k(jax.random.normal(k2, (tokens, p.experts)) + bias, p.top_k)[1]
    top = top.astype(jnp.int32)
    target = tokens * p.top_k / p.devices
    counts = [int(jnp.sum((top >= r * p.local_experts) & (top < (r + 1) * p.local_experts)))
              for r in range(p.devices)]
    rank = min(range(p.devices), key=lambda r: abs(counts[r] - target))
    meta = routing.route_metadata(top, p.local_experts, expert_offset=rank * p.local_experts)
    return meta, counts[rank]


def moe_layout(p: Preset, tokens: int, seed: int):
    """(group_sizes i32[E_local], local rows) of :func:`moe_draw`."""
    (_, sizes, _), local = moe_draw(p, tokens, seed)
    return sizes, local


def _gmm_weights(p: Preset, swiglu: bool, fp8: bool, seed: int):
    """gate_up [E, 2I, H] or down [E, H, I] (the checkpoint's [out, in]); FP8 block-scaled."""
    e = p.local_experts
    shape = (e, 2 * p.inter, p.hidden) if swiglu else (e, p.hidden, p.inter)
    w = _normal(seed, shape, BF16, 0.02)
    if not fp8:
        return w, None
    return gmm.quantize_fp8_blockwise(w)


def gmm_case(p: Preset, swiglu: bool, fp8: bool, phase: str, layout: str, impl: str,
             blocks: dict) -> Setup:
    """``phase`` decode / prefill; ``layout`` gathered (the EP step's lhs as
    ``models/moe.py`` passes it: all ranks' T*K rows, this rank's local rows sorted first, the
    rest skipped with ``skip_tail``) or packed (only the local rows, padded to 128). down is
    called with the model's ``row_split`` (``routing.row_split``: full-width N tiles)."""
    tokens = p.moe_decode_tokens if phase == "decode" else p.moe_prefill_tokens
    sizes, local = moe_layout(p, tokens, 7 if phase == "decode" else 8)
    # packed: the local rows, padded to the 128-row tile (the pad belongs to no group)
    m = tokens * p.top_k if layout == "gathered" else -(-local // 128) * 128
    k_in = p.hidden if swiglu else p.inter
    n_out = p.inter if swiglu else p.hidden
    w_shape = (p.local_experts, 2 * p.inter, p.hidden) if swiglu else (p.local_experts,
                                                                         p.hidden, p.inter)
    op = gmm.gmm_swiglu if swiglu else gmm.gmm
    over = _block(blocks, "gmm")
    bs = gmm.GmmBlockSizes(**{**dataclasses.asdict(gmm.default_block_sizes(
        m, k_in, n_out)), **over}) if over else None

    # down as models/moe.py calls it: each row one [P, H/P] slab (row_split), so tn = H
    split = None if swiglu or n_out % 128 else routing.row_split(n_out, BF16)
    extra = {} if split is None else {"row_split": split}

    def ours(impl_):
        def fn(x, w, s, sizes):  # down: [M, P, H/P] as the model's gather-reduce reads it
            return op(x, w, sizes, rhs_scale=s, impl=impl_, skip_tail=True, cost_rows=local,
                      **({"block_sizes": bs} if impl_ != "xla" else {}), **extra)
        return fn

    # [M, N] whatever the split, outside the timed call: on a TPU the [M, P, H/P] -> [M, H]
    # reshape is a relayout copy of the whole output (a 671 MB copy at prefill), which
    # the model never makes and which earlier runs timed as part of the kernel.
    flat = lambda y: y.reshape(y.shape[0], -1)  # noqa: E731

    args = lambda: (_normal(11, (m, k_in)), *_gmm_weights(p, swiglu, fp8, 12), sizes)  # noqa: E731
    interp = _interpret_peers(impl)
    tiling = tuple(_block(blocks, "megablox").get(  # its default, cut to small shapes
        "tiling", (min(128, m), min(128, k_in), min(128, 2 * n_out if swiglu else n_out))))

    def dense(w, s):  # FP8 peers dequantise inside the jit (they have no block scales)
        return w if s is None else gmm.dequantize_fp8_blockwise(w, s).astype(BF16)

    def megablox(x, w, s, sizes):
        from jax.experimental.pallas.ops.tpu.megablox import gmm as mb_gmm
        kw = dict(preferred_element_type=BF16, tiling=tiling, transpose_rhs=True,
                  interpret=interp)
        y = mb_gmm(x, dense(w, s), sizes, **kw)
        return _swiglu(y) if swiglu else y

    def ragged(x, w, s, sizes):
        dn = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2,)), ((), ())),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = jax.lax.ragged_dot_general(x, dense(w, s), sizes, dn, preferred_element_type=BF16)
        return _swiglu(y) if swiglu else y

    tag = ("(dequant)" if fp8 else "") + ("+swiglu" if swiglu else "")
    note = "dequantises the FP8 weights to bf16 inside the jit" if fp8 else None
    peers = [Impl("jax-megablox" + tag, megablox, args, note=note),
             Impl("xla-ragged_dot" + tag, ragged, args, note=note),
             Impl("ours-xla", ours("xla"), args, out=flat)]
    cost = (gmm.gmm_swiglu_cost if swiglu else gmm.gmm_cost)(
        local, k_in, n_out, p.local_experts, rhs_itemsize=1 if fp8 else 2)
    formula = ("gmm_swiglu_cost: rows*H*2 + E*2I*H*w_bytes [+ f32 block scales] + rows*I*2; "
               "flops 2*rows*H*2I + 4*rows*I" if swiglu else
               "gmm_cost: rows*I*2 + E*H*I*w_bytes [+ f32 block scales] + rows*H*2; "
               "flops 2*rows*I*H")
    shapes = (f"lhs [{m}, {k_in}] ({local} local rows over {p.local_experts} experts), "
              f"w {list(w_shape)} {'float8_e4m3fn' if fp8 else 'bfloat16'}")
    return Setup(Impl("ours", ours(impl), args, out=flat), peers, cost.bytes_accessed,
                 cost.flops, formula, shapes, valid_rows=local)


def _swiglu(y):
    n = y.shape[-1] // 2
    g, u = y[:, :n].astype(jnp.float32), y[:, n:].astype(jnp.float32)
    return (jax.nn.silu(g) * u).astype(y.dtype)


# ---- GDN


def gdn_case(p: Preset, phase: str, state_dtype, impl: str, blocks: dict) -> Setup:
    """decode: ``decode_reqs`` requests, one token each; prefill: ``prefill_reqs`` x
    ``prefill_new`` tokens continuing a cached state. States of one layer, one slot each."""
    r = p.decode_reqs if phase == "decode" else p.prefill_reqs
    q_len = 1 if phase == "decode" else p.prefill_new
    ctx = p.decode_ctx[0] if phase == "decode" else p.prefill_cached
    hk, hv, d, k = p.gdn_hk, p.gdn_hv, p.gdn_d, p.conv_k
    c = 2 * hk * d + hv * d
    t = r * q_len
    cu = jnp.arange(r + 1, dtype=jnp.int32) * q_len
    kv_lens = jnp.full((r,), ctx + q_len, jnp.int32)
    slots = jnp.arange(r, dtype=jnp.int32)
    ns = jnp.asarray([r], jnp.int32)

    def make():
        return (_normal(21, (t, c)), _normal(22, (t, hv)), _normal(23, (t, hv)),
                _normal(24, (c, k), BF16, 0.3), _normal(25, (hv,), jnp.float32, 0.5),
                _normal(26, (hv,), jnp.float32, 0.5),
                _normal(27, (1, r, conv_state_rows(k), c)),
                _normal(28, (1, r, hv, d, d), state_dtype, 0.1), cu, kv_lens, slots, ns)

    over = _block(blocks, "gdn")
    bs = gdn.GdnBlockSizes(**over) if over else None

    def ours(impl_):
        def fn(*a):
            return gdn.gated_delta_net(*a, num_k_heads=hk, decode=phase == "decode",
                                       impl=impl_, block_sizes=bs)
        return fn

    donate = {6: 1, 7: 2}
    pick = lambda o: o[0]  # noqa: E731
    cost = gdn.gated_delta_net_cost(t, r, hk, hv, d, d, conv_kernel=k, decode=phase == "decode",
                                    x_bytes=2, state_bytes=jnp.dtype(state_dtype).itemsize)
    shapes = (f"{r} requests x {q_len} tokens, Hk {hk}, Hv {hv}, D {d}, conv {k}, "
              f"state {jnp.dtype(state_dtype).name}"
              + (f", rows/step {(over or {}).get('rows_per_step', 'default')}"
                 if phase == "decode" else ""))
    return Setup(Impl("ours", ours(impl), make, donate, pick),
                 [Impl("ours-xla", ours("xla"), make, donate, pick)],
                 cost.bytes_accessed, cost.flops,
                 "gated_delta_net_cost: 2*R*(Hv*Dk*Dv*state_bytes + C*(K-1)*2) "
                 "+ T*(C + 2*Hv + Hv*Dv)*2 + C*K*2 + 8*Hv", shapes)


# ---- routing


def routing_case(p: Preset, op: str, phase: str, impl: str, blocks: dict) -> Setup:
    """The EP step's data movers at its row counts: ``gather`` of the local rows of all ranks'
    T*K assignments (num_rows = local), ``reduce`` of those rows back to the T tokens."""
    tokens = p.moe_decode_tokens if phase == "decode" else p.moe_prefill_tokens
    (token_idx, _, rows), local = moe_draw(p, tokens, 7 if phase == "decode" else 8)
    m, h = tokens * p.top_k, p.hidden
    over = _block(blocks, "routing")
    bs = routing.RoutingBlockSizes(**over) if over else None
    if op == "gather":
        num = jnp.asarray(local, jnp.int32)

        def ours(impl_):
            return lambda x, idx, n: routing.gather_rows(x, idx, num_rows=n, cost_rows=local,
                                                         impl=impl_, block_sizes=bs)
        args = lambda: (_normal(33, (tokens, h)), token_idx, num)  # noqa: E731
        cost = routing.gather_rows_cost(local, h)
        formula = "gather_rows_cost: 2*local*H*2 + 4*local"
        shapes = f"x [{tokens}, {h}] -> [{m}, {h}], {local} local rows"
    else:
        p_split = routing.row_split(h, BF16)

        def ours(impl_):
            return lambda y, rows, w: routing.gather_reduce(y, rows, w, cost_reads=local,
                                                            impl=impl_, block_sizes=bs)
        args = lambda: (_normal(34, (m, p_split, h // p_split)),  # noqa: E731
                        rows, jax.random.uniform(_key(35), (tokens, p.top_k), jnp.float32))
        cost = routing.gather_reduce_cost(tokens, p.top_k, h, reads=local)
        formula = "gather_reduce_cost: (local + T)*H*2 + 8*T*K; flops 2*local*H"
        shapes = (f"y [{m}, {p_split}, {h // p_split}] (as the down GMM writes it) -> "
                  f"[{tokens}, {h}], {local} local rows")
    return Setup(Impl("ours", ours(impl), args), [Impl("xla-reference", ours("reference"), args)],
                 cost.bytes_accessed, cost.flops, formula, shapes,
                 valid_rows=local if op == "gather" else None)


# ----------------------------------------------------------------------------- case list


def gdn_rows_cases(p: Preset, rows: tuple[int, ...]) -> list[Case]:
    """The GDN decode cases again at each of ``rows`` decode rows per grid step
    (``GdnBlockSizes.rows_per_step`` over ``--block-sizes``' gdn fields), named ``...-rb<N>``."""
    out = []
    for n in rows:
        for name, dtype in (("bf16", BF16), ("f32", jnp.float32)):
            out.append(Case(f"gdn/decode-{p.decode_reqs}-{name}-state-rb{n}",
                            lambda p, i, b, n=n, dt=dtype: gdn_case(
                                p, "decode", dt, i,
                                {**b, "gdn": {**b.get("gdn", {}), "rows_per_step": n}})))
    return out


def ceiling_case(p: Preset, block_rows: int, impl: str, blocks: dict,
                 in_flight: int = 0) -> Setup:
    """The HBM ceiling (``kernel_ceilings.py``): a Pallas read of an array shaped as the local
    experts' gate_up weights [E, 2I, H] bf16 in [1, block_rows, H] blocks (block_rows 256:
    the GMM decode tile's bytes per weight half), beside XLA's reduction of it; with
    ``in_flight``, the manual-DMA read of [block_rows, H] chunks, that many DMAs outstanding."""
    import kernel_ceilings as ceil
    shape = (p.local_experts, 2 * p.inter, p.hidden)
    rows = min(block_rows, shape[1])
    args = lambda: (_normal(12, shape, BF16, 0.02),)  # noqa: E731
    interp = impl == "interpret"
    if in_flight:
        read = lambda x: ceil.dma_read(x, chunk_rows=rows, in_flight=in_flight,  # noqa: E731
                                       interpret=interp)
    else:
        read = lambda x: ceil.stream_read(x, block_rows=rows, interpret=interp)  # noqa: E731
    ours = Impl("ours", read, args)
    peers = [Impl("xla-sum", ceil.xla_sum, args)]
    nbytes = 2 * shape[0] * shape[1] * shape[2]
    how = f"{in_flight} DMAs in flight" if in_flight else "BlockSpec pipeline"
    return Setup(ours, peers, nbytes, 0, "bytes: E*2I*H*2 (one read); flops 0",
                 f"x {list(shape)} bfloat16, blocks [1, {rows}, {shape[2]}], {how}")


def attention_matmuls_case(p: Preset, impl: str, blocks: dict) -> Setup:
    """The MXU ceiling of the attention prefill case (``kernel_ceilings.attention_matmuls``):
    its q and each item's K / V as dense arrays, in our kernel's blocks (the default, or
    ``blocks["attention"]``), rated with the prefill case's own bytes and FLOPs so that its %
    of the roofline reads against the kernel's. Peer: XLA's two einsums over every key (no
    causal skip: 4/3 of the counted FLOPs at 1,024 new on 1,024 cached)."""
    import kernel_ceilings as ceil
    r, t, ctx = p.prefill_reqs, p.prefill_new, p.prefill_cached + p.prefill_new
    g = p.q_heads // p.kv_heads
    bs = dataclasses.replace(rpa.BlockSizes.get_default(r * t, g, p.page, -(-ctx // p.page)),
                             **_block(blocks, "attention"))
    q_tokens, kv_block = min(bs.prefill_q_tokens, t), bs.kv_pages_per_block * p.page
    if t % q_tokens or ctx % kv_block:
        raise ValueError(f"blocks of {q_tokens} q tokens / {kv_block} keys do not tile "
                         f"{t} new tokens on a context of {ctx}")
    args = lambda: (_normal(1, (r, p.kv_heads, t * g, p.head_dim)),  # noqa: E731
                    _normal(2, (r, p.kv_heads, ctx, p.head_dim)),
                    _normal(3, (r, p.kv_heads, ctx, p.head_dim)))
    interp = impl == "interpret"
    ours = Impl("ours", lambda q, k, v: ceil.attention_matmuls(
        q, k, v, group=g, q_tokens=q_tokens, kv_block=kv_block, interpret=interp), args)
    peers = [Impl("xla-dense", ceil.xla_attention_matmuls, args,
                  note="every key for every query: more FLOPs than the causal count")]
    nbytes, flops = attention_cost(p, AttnBatch((t,) * r, (ctx,) * r), 2, False)
    return Setup(ours, peers, nbytes, flops, "as the attention prefill case",
                 f"q [{r}, {p.kv_heads}, {t}*{g}, {p.head_dim}], k, v [{r}, {p.kv_heads}, "
                 f"{ctx}, {p.head_dim}] bfloat16, blocks {q_tokens} q tokens x {kv_block} keys")


def gdn_matmuls_case(p: Preset, impl: str, blocks: dict) -> Setup:
    """The matmul chain of the GDN chunked prefill case (``kernel_ceilings.gdn_chunk_matmuls``):
    bf16 q, k, v already in the chunk kernel's [head block, chunk] order, its head block (the
    shape default, or ``blocks["gdn"]["k_heads_per_block"]``), rated with the prefill case's
    own bytes and FLOPs."""
    import kernel_ceilings as ceil
    hk, hv, d = p.gdn_hk, p.gdn_hv, p.gdn_d
    rep = hv // hk
    kb = (_block(blocks, "gdn").get("k_heads_per_block")
          or gdn_geometry.default_chunk_k_heads_per_block(hk, hv, d, d))
    n, L = p.prefill_reqs * -(-p.prefill_new // gdn.CHUNK_SIZE), gdn.CHUNK_SIZE
    qk = (hk // kb, n, kb, L, d)
    args = lambda: (_normal(41, qk, BF16, 0.1), _normal(42, qk, BF16, 0.1),  # noqa: E731
                    _normal(43, (hk // kb, n, kb * rep, L, d)),
                    jax.random.uniform(_key(44), (hk // kb, n, L, kb * rep), jnp.float32))
    interp = impl == "interpret"
    ours = Impl("ours", lambda q, k, v, beta: ceil.gdn_chunk_matmuls(
        q, k, v, beta, rep=rep, interpret=interp), args)
    t = p.prefill_reqs * p.prefill_new
    cost = gdn.gated_delta_net_cost(t, p.prefill_reqs, hk, hv, d, d, conv_kernel=p.conv_k,
                                    decode=False, x_bytes=2, state_bytes=4)
    return Setup(ours, [], cost.bytes_accessed, cost.flops, "as the GDN prefill case",
                 f"q, k [{hk // kb}, {n}, {kb}, {L}, {d}], v [{hk // kb}, {n}, {kb * rep}, {L}, "
                 f"{d}] bfloat16 ({kb} qk heads a block)")


def cases(p: Preset, gdn_rows: tuple[int, ...] = ()) -> list[Case]:
    """Every case; ``gdn_rows``: also the GDN decode cases at these rows per grid step."""
    d = p.decode_reqs
    c2, c8 = p.decode_ctx
    dec = lambda ctx: AttnBatch((1,) * d, (ctx,) * d)  # noqa: E731
    pre = AttnBatch((p.prefill_new,) * p.prefill_reqs,
                    (p.prefill_cached + p.prefill_new,) * p.prefill_reqs)
    mixed = AttnBatch((1,) * p.mixed_decode + (p.prefill_new,),
                      (c2,) * p.mixed_decode + (p.prefill_cached + p.prefill_new,))
    fp8 = jnp.float8_e4m3fn
    attn = lambda batch, dtype: (  # noqa: E731
        lambda p, i, b: attention_case(p, batch, dtype, i, b))
    out = [
        Case(f"attention/decode-{d}x{c2}-bf16", attn(dec(c2), BF16)),
        Case(f"attention/decode-{d}x{c8}-bf16", attn(dec(c8), BF16)),
        Case(f"attention/decode-{d}x{c8}-fp8", attn(dec(c8), fp8)),
        Case(f"attention/prefill-{p.prefill_reqs}x{p.prefill_new}on{p.prefill_cached}-bf16",
             attn(pre, BF16)),
        Case(f"attention/mixed-{p.mixed_decode}dec+1x{p.prefill_new}-bf16", attn(mixed, BF16)),
        Case(f"attention/kv-write-{d}x{c2}", kv_write_case),
    ]
    for w in ("bf16", "fp8"):
        for swiglu in (True, False):
            op = "gate_up" if swiglu else "down"
            for phase, layout in (("decode", "gathered"), ("prefill", "gathered"),
                                  ("prefill", "packed")):
                out.append(Case(f"gmm/{op}-{w}-{phase}-{layout}",
                                lambda p, i, b, s=swiglu, f=w == "fp8", ph=phase, la=layout:
                                gmm_case(p, s, f, ph, la, i, b)))
    out += [
        Case(f"gdn/decode-{d}-bf16-state", lambda p, i, b: gdn_case(p, "decode", BF16, i, b)),
        Case(f"gdn/decode-{d}-f32-state", lambda p, i, b: gdn_case(p, "decode", jnp.float32, i, b)),
        *gdn_rows_cases(p, gdn_rows),
        Case(f"gdn/prefill-{p.prefill_reqs}x{p.prefill_new}-f32-state",
             lambda p, i, b: gdn_case(p, "prefill", jnp.float32, i, b)),
    ]
    out += [Case(f"ceiling/hbm-read-{r}rows", lambda p, i, b, r=r: ceiling_case(p, r, i, b))
            for r in (256, 512)]
    out += [Case(f"ceiling/hbm-dma-{r}rows-x{f}",
                 lambda p, i, b, r=r, f=f: ceiling_case(p, r, i, b, in_flight=f))
            for r, f in ((512, 1), (512, 2), (512, 4), (256, 4), (128, 8), (64, 16), (32, 16))]
    out += [Case("ceiling/attention-prefill-matmuls", attention_matmuls_case),
            Case("ceiling/gdn-chunk-matmuls", gdn_matmuls_case)]
    for op in ("gather", "reduce"):
        for phase in ("decode", "prefill"):
            out.append(Case(f"routing/{op}-{phase}",
                            lambda p, i, b, o=op, ph=phase: routing_case(p, o, ph, i, b)))
    reason = ("needs shard_map over a multi-device (chip, die) mesh with remote DMAs; one chip "
              "is one device")
    out += [Case("collectives/packed_all_gather", None, skip=reason),
            Case("collectives/hierarchical_reduce_scatter", None, skip=reason)]
    return out


# ----------------------------------------------------------------------------- timing


class Timing(NamedTuple):
    """``time_call``'s figures: ms / min_ms the device's time per call (``device_timing``:
    back to back, the host's wait taken away), iters the calls timed so, first the compared
    output of the first call, waited_ms the median of calls each waited for alone (the figure
    earlier runs reported: device time plus the host's round trip)."""

    ms: float
    min_ms: float
    iters: int
    first: Any
    waited_ms: float


def time_call(impl: Impl, warmup: int, iters: int, budget_s: float = float("inf"),
              rounds: int = 3) -> Timing:
    """Time ``impl`` on fixed inputs: the first call compiles, ``warmup - 1`` more are waited
    for one by one, then ``rounds`` runs of ``iters`` calls back to back
    (``device_timing.device_ms``). When a warm call shows that this would take more than
    ``budget_s``, the warm-ups stop and the calls are cut to fit (at least 2 a run), so a very
    slow peer cannot eat the chip's time."""
    f = jax.jit(impl.fn, donate_argnums=tuple(impl.donate))
    args = list(impl.make_args())

    def dispatch():
        out = f(*args)
        for a, o in impl.donate.items():  # a single output replaces its one donated input
            args[a] = out[o] if isinstance(out, (tuple, list)) else out
        return out

    first = np.asarray(impl.out(jax.block_until_ready(dispatch())).astype(jnp.float32))
    ms = None
    for i in range(1, max(warmup, 2)):
        ms = waited_ms(dispatch)
        if ms * (warmup - 1 - i + rounds * (iters + 1)) > 1e3 * budget_s:
            break
    n = max(2, min(iters, int(1e3 * budget_s / (rounds * ms)) - 1))
    med, mn, waited = device_ms(dispatch, n, rounds)
    del args
    return Timing(med, mn, rounds * n, first, waited)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _rates(nbytes, flops, ms, hw):
    """GB/s, TFLOP/s, roofline ms and fraction of it for a time in ms (hw None: n/a)."""
    gbps, tflops = nbytes / ms / 1e6, flops / ms / 1e9
    if hw is None:
        return gbps, tflops, None, None
    roof = 1e3 * max(nbytes / hw.hbm_bandwidth, flops / hw.bf16_flops)
    return gbps, tflops, roof, roof / ms


def run_case(case: Case, p: Preset, impl: str, args, hw) -> dict:
    row: dict[str, Any] = {"name": case.name}
    if case.skip:
        row["skipped"] = case.skip
        return row
    try:
        s = case.build(p, impl, args.block_sizes)
    except Exception as e:  # a case that cannot even be set up (e.g. FP8 at a tiny width)
        row["error"] = _first_line(e)
        return row
    row.update(shapes=s.shapes, formula=s.formula, bytes=int(s.bytes), flops=int(s.flops))
    ours_out = None
    start = time.perf_counter()
    print("    ours", file=sys.stderr, flush=True)  # a call that never returns names itself
    try:
        t = time_call(s.ours, args.warmup, args.iters, args.budget_s)
        ms, ours_out = t.ms, t.first
        gbps, tf, roof, frac = _rates(s.bytes, s.flops, ms, hw)
        row["ours"] = dict(impl=impl, time_ms=ms, min_ms=t.min_ms, iters=t.iters,
                           waited_ms=t.waited_ms, gb_per_s=gbps,
                           tflop_per_s=tf, roofline_ms=roof, fraction_of_roofline=frac)
    except Exception as e:
        row["ours"] = dict(impl=impl, error=_first_line(e))
    row["ours"]["seconds"] = time.perf_counter() - start  # inputs, compile and calls
    row["peers"] = [_run_peer(peer, s, row, ours_out, args, hw) for peer in s.peers]
    del s
    gc.collect()
    return row


def _run_peer(peer: Impl, s: Setup, row: dict, ours_out, args, hw) -> dict:
    out: dict[str, Any] = {"name": peer.name}
    if peer.note:
        out["note"] = peer.note
    start = time.perf_counter()
    print(f"    {peer.name}", file=sys.stderr, flush=True)
    try:
        t = time_call(peer, args.warmup, args.iters, args.budget_s)
        ms, peer_out = t.ms, t.first
    except Exception as e:
        out.update(error=_first_line(e), seconds=time.perf_counter() - start)
        return out
    out["seconds"] = time.perf_counter() - start
    _, _, _, frac = _rates(s.bytes, s.flops, ms, hw)
    out.update(time_ms=ms, min_ms=t.min_ms, iters=t.iters, waited_ms=t.waited_ms,
               fraction_of_roofline=frac)
    ours_ms = row.get("ours", {}).get("time_ms")
    if ours_ms:
        out["speedup"] = ms / ours_ms
    if ours_out is not None and peer_out is not None and ours_out.shape == peer_out.shape:
        n = s.valid_rows
        a, b = (ours_out, peer_out) if n is None else (ours_out[:n], peer_out[:n])
        out["max_abs_diff_vs_peer"] = float(np.max(np.abs(a - b))) if a.size else 0.0
    return out


# ----------------------------------------------------------------------------- output


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per (case, peer): name, ours ms, GB/s, TFLOP/s, % roofline, peer, peer ms,
    peer % roofline, speed-up (peer_ms / ours_ms), max abs diff (ours vs peer)."""
    lines = []
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append([r["name"], "skip" if "skipped" in r else "error", "", "", "",
                          (r.get("skipped") or r.get("error"))[:80], "", "", "", ""])
            continue
        o = r["ours"]
        if "error" in o:
            ours = ["error: " + o["error"][:40], "", "", ""]
        else:
            frac = o.get("fraction_of_roofline")
            ours = [_fmt(o["time_ms"], ".3f"), _fmt(o["gb_per_s"], ".4g"),
                    _fmt(o["tflop_per_s"], ".4g"),
                    _fmt(None if frac is None else 100 * frac, ".1f")]
        for pe in r["peers"] or [{"name": ""}]:
            if "error" in pe:
                peer = [pe["name"], "error: " + pe["error"][:50], "", "", ""]
            else:
                frac = pe.get("fraction_of_roofline")
                peer = [pe["name"], _fmt(pe.get("time_ms"), ".3f"),
                        _fmt(None if frac is None else 100 * frac, ".1f"),
                        _fmt(pe.get("speedup"), ".2f"), _fmt(pe.get("max_abs_diff_vs_peer"), ".3g")]
            lines.append([r["name"], *ours, *peer])
    return lines


HEADER = ["case", "ours ms", "GB/s", "TFLOP/s", "% roof", "peer", "peer ms", "peer % roof",
          "speed-up", "max abs diff"]


def print_table(rows: list[dict]) -> None:
    lines = [HEADER] + table_rows(rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def markdown(rows: list[dict], meta: dict) -> str:
    head = (f"Kernels on {meta['device_kind']} (preset {meta['preset']}, jax "
            f"{meta['jax_version']}, {meta['timestamp']}); speed-up = peer ms / ours ms.\n\n")
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in line) + " |"
              for line in table_rows(rows)]
    return head + "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- compile-only


def compile_case(case: Case, p: Preset, mesh, blocks: dict):
    """Lower + compile ``case``'s own implementation (impl="pallas") for ``mesh``'s TPU
    devices without a TPU: its inputs as abstract arrays -> ``tpu_compile.CompileReport``."""
    from sglang_tpu_backend.kernels import tpu_compile
    s = case.build(p, "pallas", blocks)  # small metadata only; inputs stay lazy
    specs = jax.eval_shape(s.ours.make_args)
    aargs = jax.tree.map(lambda a: tpu_compile.abstract(a.shape, a.dtype, mesh), specs)
    return tpu_compile.compile_for_tpu(s.ours.fn, aargs, mesh, donate_argnums=tuple(s.ours.donate))


def compile_only(topology: str, p: Preset, selected: list[Case], blocks: dict) -> list[dict]:
    """Lower + compile each of our cases (impl="pallas") for ``topology`` without a TPU."""
    from sglang_tpu_backend.kernels import tpu_compile
    mesh = tpu_compile.core_mesh(topology)
    out = []
    for case in selected:
        if case.skip:
            continue
        rec: dict[str, Any] = {"name": case.name}
        try:
            rep = compile_case(case, p, mesh, blocks)
            rec.update(ok=True, seconds=rep.seconds, memory=rep.memory,
                       vmem_used=[k.vmem_used_bytes for k in rep.kernels])
            print(f"{case.name}: compile OK; {rep.summary()}", flush=True)
        except Exception as e:
            rec.update(ok=False, error=_first_line(e))
            print(f"{case.name}: compile FAILED: {rec['error']}", flush=True)
        out.append(rec)
        gc.collect()
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="397b", choices=["397b", "tiny", "smoke"])
    ap.add_argument("--only", action="append", default=[],
                    help="run the cases whose name contains this (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--interpret", action="store_true",
                    help='our kernels with impl="interpret", bundled ones in interpret mode')
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=30.0,
                    help="seconds of timed calls per implementation; a slower one gets fewer "
                         "calls (its JSON 'iters' says how many)")
    ap.add_argument("--block-sizes", type=json.loads, default={},
                    help='JSON per kernel: {"attention": {"kv_pages_per_block": 4}, "gmm": '
                         '{"tm": 256}, "gdn": {"k_heads_per_block": 2}, "routing": {...}, '
                         '"rpa": {"num_kv_pages_per_block": 2, "num_queries_per_block": 32}, '
                         '"paged_attention": {"pages_per_compute_block": 4}, '
                         '"megablox": {"tiling": [128, 512, 512]}}')
    ap.add_argument("--gdn-rows", type=lambda v: tuple(int(x) for x in v.split(",")),
                    default=(), metavar="N,N,...",
                    help="also time the GDN decode cases at these rows per grid step "
                         "(GdnBlockSizes.rows_per_step), e.g. 1,8: cases gdn/decode-...-rb1, "
                         "-rb8 beside the default's")
    ap.add_argument("--measure-cpu", action="store_true",
                    help="off a TPU, measure this machine's peaks for the roofline columns")
    ap.add_argument("--json-out")
    ap.add_argument("--markdown-out")
    ap.add_argument("--compile-only", metavar="TOPOLOGY",
                    help="only lower + compile our cases for e.g. v5e:2x2 (libtpu, no TPU)")
    return ap.parse_args(argv)


def hardware(measure_cpu: bool):
    """Peaks for the roofline columns: the TPU generation's, or None (n/a) where unknown."""
    dev = jax.devices()[0]
    if dev.platform == "tpu":
        try:
            return roofline.hardware_for(dev.device_kind)
        except ValueError as e:
            print(f"roofline n/a: {e}", file=sys.stderr)
            return None
    return roofline.measure_cpu() if measure_cpu else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    p = preset(args.preset)
    selected = [c for c in cases(p, args.gdn_rows)
                if not args.only or any(s in c.name for s in args.only)]
    if args.list:
        for c in selected:
            print(c.name + (f"  (skipped: {c.skip})" if c.skip else ""))
        return {"cases": [c.name for c in selected]}
    meta = dict(device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                preset=args.preset, timestamp=datetime.datetime.now(datetime.timezone.utc)
                .isoformat(timespec="seconds"), preset_shapes=dataclasses.asdict(p))
    if args.compile_only:
        result = dict(meta, topology=args.compile_only,
                      compiles=compile_only(args.compile_only, p, selected, args.block_sizes))
    else:
        impl = "interpret" if args.interpret else "pallas"
        hw = hardware(args.measure_cpu)
        meta.update(impl=impl, warmup=args.warmup, iters=args.iters,
                    hardware=None if hw is None else dataclasses.asdict(hw))
        rows = []
        for case in selected:  # saved after every case: a run cut short keeps what it timed
            print(f"... {case.name}", file=sys.stderr, flush=True)
            rows.append(run_case(case, p, impl, args, hw))
            spent = [(x["name"], x.get("seconds")) for x in [{"name": "ours", **rows[-1].get(
                "ours", {})}] + rows[-1].get("peers", [])]
            print("    seconds: " + ", ".join(f"{n} {sec:.0f}" for n, sec in spent
                                           if sec is not None), file=sys.stderr, flush=True)
            result = dict(meta, rows=rows)
            _save(result, args)
        result = dict(meta, rows=rows)
        print_table(rows)
    _save(result, args)
    return result


def _save(result: dict, args) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1, default=str))
    if args.markdown_out and "rows" in result:
        Path(args.markdown_out).write_text(markdown(result["rows"], result))


if __name__ == "__main__":
    main()
