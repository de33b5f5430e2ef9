"""Grouped matmul (GMM) over ragged expert groups, with fused SwiGLU and FP8 weights.

Dimension letters: M rows (token-expert assignments, sorted by group), K contraction
(hidden), N output columns, G groups (local experts).

``lhs`` rows are sorted by group: group ``g`` owns rows ``off[g]:off[g+1]`` with
``off = [0, cumsum(group_sizes)]``. Rows past ``sum(group_sizes)`` produce zeros, or with
``skip_tail=True`` are left unwritten (the Pallas kernel neither reads nor writes their tiles:
an expert-parallel step whose local groups hold ~1/D of the M rows moves only those).

``rhs`` holds each group's weights as ``[N, K]`` (output rows, contraction last): the
checkpoints' ``[out, in]`` layout, so weights are loaded as stored, never transposed; every
path contracts lhs's K with rhs's last axis (``out[r] = lhs[r] @ rhs[g].T``).

FP8: ``rhs`` may be ``float8_e4m3fn`` with a block scale ``rhs_scale f32[G, ceil(N/128),
ceil(K/128)]`` (``w[g,n,k] = rhs[g,n,k] * rhs_scale[g, n//128, k//128]``: the checkpoint's
``weight_scale_inv`` as stored). With ``quantize_lhs=True`` the activations are also
quantised to e4m3, per row per 512-wide K sub-channel (scale = amax / 448), inside the kernel.
The Pallas kernel reads the e4m3fn bits as e4m3b11 (``gmm_quant.e4m3_as_b11``: one VPU unpack;
the x16 goes into the block's scale) and multiplies each 128 x 128 weight block unscaled (exact
in bf16), scaling the block's f32 product [tm, 128] instead (``_accumulate_fp8``). With a
quantised lhs the blocks are dequantised into a VMEM tile first.

Pallas kernel (megablox-style): grid ``(N tiles, visits, K tiles)``. A *visit* is one
(M tile, group) pair whose row ranges overlap; the visit list is computed in the wrapper
and scalar-prefetched, so an M tile is visited once per group it overlaps (at least once,
so tiles past the last group still write zeros; with ``skip_tail`` they get no visit). Rows
of other groups are masked to zero in the lhs tile (in the product, for FP8 weights). One fp32
accumulator per M tile lives in VMEM across its visits. When K is one tile (the default up to
K = 4096) the weights stay in HBM and each run of visits of one group has its tile fetched
while the run before it computes (``gmm_weight_pipeline.py``), not one step ahead as a
BlockSpec input would.

Files: this one holds the contract, the reference, the Pallas kernel and the API;
``gmm_quant.py`` the FP8 quantisation of weights and activations; ``gmm_xla.py`` the XLA path.

XLA path (``impl="xla"``, what ``"auto"`` picks off-TPU): the same visit idea in plain XLA.
The sorted rows are cut into tiles (``xla_tile_rows``) that each belong to one group; a loop
over the tiles in use multiplies each tile's rows by its group's weights, sliced out of the
stack (no gathered copy of every tile's weights), and each row reads its result back. The
reference (one masked dense matmul per group over all M rows) stays the obvious oracle.

TPU assumptions: tiles tm x tk x tn with tm a multiple of 16 and tk, tn multiples of 128
(defaults 128 x K x 512 up to K = 4096: for the model's gate_up, K = 4096 and N = 2 x 1024,
a step's two weight tiles [tn, tk] are 4 MiB each in bf16; ``gmm_vmem_bytes`` estimates the
kernel's VMEM and the scoped limit is raised past the compiler's default when it needs more).
Shapes that are not tile multiples are zero-padded by the wrapper (never the case for the
model's K and N). The grid's visit axis has a traced bound, the visits in use (as megablox's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import block_tables, dispatch
from .cost import Cost
from .gmm_quant import (B11_FACTOR, FP8_DTYPE, FP8_MAX, LHS_QUANT_BLOCK, WEIGHT_BLOCK,
                        dequantize_fp8_blockwise, e4m3_as_b11, quantize_fp8_blockwise,
                        quantize_lhs_reference, quantize_rows)
from .gmm_weight_pipeline import next_groups, run_weights
from .gmm_weight_pipeline import scratch as weight_scratch
from .gmm_xla import (XLA_MAX_TILE_ROWS, XLA_TILE_ROWS, dot_t, xla_gmm_impl, xla_tile_plan,
                      xla_tile_rows)

# The grouped matmul's API, its FP8 helpers (gmm_quant.py) and XLA path (gmm_xla.py) included.
__all__ = [
    "GmmBlockSizes", "default_block_sizes", "gmm", "gmm_swiglu", "ref_gmm", "ref_gmm_swiglu",
    "gmm_cost", "gmm_swiglu_cost", "make_group_metadata", "FP8_DTYPE", "FP8_MAX", "WEIGHT_BLOCK",
    "LHS_QUANT_BLOCK", "quantize_fp8_blockwise", "dequantize_fp8_blockwise",
    "quantize_lhs_reference", "xla_gmm_impl", "xla_tile_plan", "xla_tile_rows", "XLA_TILE_ROWS",
    "XLA_MAX_TILE_ROWS",
]



@dataclasses.dataclass(frozen=True)
class GmmBlockSizes:
    """Tile sizes: tm rows (multiple of 16), tk / tn multiples of 128."""

    tm: int = 128
    tk: int = 512
    tn: int = 512


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _largest_dividing_tile(dim: int, cap: int) -> int:
    """Largest of cap, cap/2, ..., 128 that divides round_up(dim, 128)."""
    padded = _round_up(max(dim, 1), 128)
    t = cap
    while t > 128 and padded % t:
        t //= 2
    return t


MAX_TK = 4096  # the whole contraction of the model's gate_up (hidden 4096) in one tile


def default_block_sizes(m: int, k: int, n: int, *, quantize_lhs: bool = False) -> GmmBlockSizes:
    """Tiles for an [m, k] x [n, k]^T problem (n = one half's width for SwiGLU).

    tk is the whole K where it is at most ``MAX_TK`` (else the largest power-of-two divisor
    below): consecutive visits of one group (a group spanning M tiles) then keep its weight
    tile, a tile's visits keep its lhs tile, and a step moves a tile of [tn, K]. On a v5e at
    the 397B decode shapes (~640 local rows over 64 experts) tk = K ran gate_up in 2.06 ms
    against 3.32 ms at tk = 512, and down in 1.41 against 2.21 ms.
    """
    tm = min(128, _round_up(max(m, 1), 16))
    if quantize_lhs:
        tk = min(LHS_QUANT_BLOCK, _round_up(k, 128))  # one tile = one 512 sub-channel
    else:
        tk = _largest_dividing_tile(k, MAX_TK)
    return GmmBlockSizes(tm=tm, tk=tk, tn=_largest_dividing_tile(n, 512))


# --------------------------------------------------------------------------- reference


def _ref_dense_inputs(lhs, rhs, rhs_scale, quantize_lhs):
    x = quantize_lhs_reference(lhs) if quantize_lhs else lhs.astype(jnp.float32)
    if rhs_scale is not None:
        w = dequantize_fp8_blockwise(rhs, rhs_scale)
    else:
        w = rhs.astype(jnp.float32)
    return x, w  # f32[M, K], f32[G, N, K]


def _ref_grouped(x, w, group_sizes):
    """f32[M, N]: rows of group g times w[g].T; rows past the groups are zero."""
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # i32[G]
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")  # i32[M]
    out = jnp.zeros((m, w.shape[1]), jnp.float32)
    for g in range(w.shape[0]):  # one masked dense matmul per group (reference only)
        y = dot_t(x, w[g], precision=jax.lax.Precision.HIGHEST)
        out = out + jnp.where((row_group == g)[:, None], y, 0.0)
    return out


def ref_gmm(lhs, rhs, group_sizes, *, rhs_scale=None, quantize_lhs=False, out_dtype=None):
    """Plain-jnp grouped matmul in fp32; same contract as :func:`gmm`."""
    _validate(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, swiglu=False)
    x, w = _ref_dense_inputs(lhs, rhs, rhs_scale, quantize_lhs)
    return _ref_grouped(x, w, group_sizes).astype(out_dtype or lhs.dtype)


def ref_gmm_swiglu(lhs, rhs, group_sizes, *, rhs_scale=None, quantize_lhs=False, out_dtype=None):
    """Plain-jnp ``silu(lhs @ gate) * (lhs @ up)`` per group in fp32; see :func:`gmm_swiglu`."""
    _validate(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, swiglu=True)
    x, w = _ref_dense_inputs(lhs, rhs, rhs_scale, quantize_lhs)
    h = _ref_grouped(x, w, group_sizes)  # f32[M, 2N]
    n = rhs.shape[1] // 2
    return (jax.nn.silu(h[:, :n]) * h[:, n:]).astype(out_dtype or lhs.dtype)


# --------------------------------------------------------------------------- validation


def _validate(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, *, swiglu):
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"lhs must be [M, K] and rhs [G, N, K]; got {lhs.shape}, {rhs.shape}")
    m, k = lhs.shape
    g, n, k2 = rhs.shape
    if k2 != k:
        raise ValueError(f"contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape}")
    if g < 1:
        raise ValueError(f"rhs needs at least one group, got {rhs.shape}")
    if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be int[{g}], got {group_sizes.dtype}{group_sizes.shape}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating) or lhs.dtype == FP8_DTYPE:
        raise ValueError(f"lhs must be bf16/f32, got {lhs.dtype}")
    if swiglu and n % 2:
        raise ValueError(f"gmm_swiglu rhs must be [G, 2N, K] (gate | up rows), got {rhs.shape}")
    is_fp8 = rhs.dtype == FP8_DTYPE
    if is_fp8 != (rhs_scale is not None):
        raise ValueError(
            f"rhs_scale is required exactly when rhs is float8_e4m3fn (rhs {rhs.dtype}, "
            f"rhs_scale {None if rhs_scale is None else rhs_scale.shape})")
    if is_fp8:
        want = (g, -(-n // WEIGHT_BLOCK), -(-k // WEIGHT_BLOCK))
        if rhs_scale.shape != want:
            raise ValueError(f"rhs_scale must be f32{list(want)} for rhs {rhs.shape}, got {rhs_scale.shape}")
        if swiglu and (n // 2) % WEIGHT_BLOCK:
            raise ValueError(f"FP8 gmm_swiglu needs N % {WEIGHT_BLOCK} == 0, got rhs {rhs.shape}")
    elif not jnp.issubdtype(rhs.dtype, jnp.floating):
        raise ValueError(f"rhs must be float, got {rhs.dtype}")
    if quantize_lhs and not is_fp8:
        raise ValueError("quantize_lhs=True needs FP8 rhs with rhs_scale")


def _table_blocks(m: int, k: int, n: int, quantize_lhs: bool) -> GmmBlockSizes:
    """default_block_sizes with this TPU generation's table overrides (block_tables.py) where
    they are legal tiles that need no more padding than the default (tm <= round_up(M, 16);
    tk, tn divide K, N rounded up to 128)."""
    def legal(b: GmmBlockSizes) -> bool:
        try:
            _validate_blocks(b, k, quantize_lhs)
        except ValueError:
            return False
        return (b.tm <= _round_up(max(m, 1), 16) and _round_up(k, 128) % b.tk == 0
                and _round_up(n, 128) % b.tn == 0)

    return block_tables.pick("gmm", default_block_sizes(m, k, n, quantize_lhs=quantize_lhs), legal)


def _validate_blocks(b: GmmBlockSizes, k: int, quantize_lhs: bool):
    if b.tm % 16 or b.tm <= 0 or b.tk % 128 or b.tk <= 0 or b.tn % 128 or b.tn <= 0:
        raise ValueError(f"block sizes must be tm % 16 == 0, tk % 128 == 0, tn % 128 == 0: {b}")
    if quantize_lhs and b.tk != min(LHS_QUANT_BLOCK, _round_up(k, 128)):
        raise ValueError(
            f"quantize_lhs needs tk == min(512, round_up(K, 128)) = "
            f"{min(LHS_QUANT_BLOCK, _round_up(k, 128))} (one sub-channel per tile), got {b.tk}")


_VMEM_MIN = 16 << 20  # the smallest default scoped VMEM limit (v5e)
_VMEM_MAX = 60 << 20  # under TPU7x's 64 MiB per TensorCore (v5e and v6e have 128 MiB)


def gmm_vmem_bytes(b: GmmBlockSizes, *, halves: int, lhs_bytes: int, rhs_bytes: int,
                   out_bytes: int, dequant_tile: bool) -> int:
    """Estimated VMEM of the kernel at tiles ``b``, in bytes: the pipelined blocks twice
    (double buffer: the lhs tile [tm, tk], ``halves`` weight tiles [tn, tk], the output tile
    [tm, tn]), the f32 accumulators [tm, tn] per half, with ``dequant_tile`` (FP8 weights
    and a quantised lhs) the dequantised weight tile and as much again for its conversion's
    temporaries (the TPU7x compile of the 397B gate_up needed 0.5 MiB past the estimate
    without them), and one f32 product [tm, tn] per half. FP8 weights with a bf16 / f32 lhs
    go block by block (``_accumulate_fp8``): no tile, temporaries of one 128 x 128 block."""
    blocks = (b.tm * b.tk * lhs_bytes + halves * b.tn * b.tk * rhs_bytes
              + b.tm * b.tn * out_bytes)
    scratch = 2 * halves * b.tm * b.tn * 4 + (2 * b.tn * b.tk * 2 if dequant_tile else 0)
    return 2 * blocks + scratch


def gmm_vmem_limit(need: int) -> int | None:
    """Scoped VMEM limit for an estimate of ``need`` bytes: None (the compiler's default)
    when it fits in 16 MiB with 25% headroom, else that, capped at 60 MiB."""
    need = int(1.25 * need)
    return None if need <= _VMEM_MIN else min(need, _VMEM_MAX)


# --------------------------------------------------------------------------- metadata


def make_group_metadata(group_sizes, num_rows: int, tm: int, *, skip_tail: bool = False):
    """Visit list for the kernel grid: one visit per (M tile, overlapping non-empty group).

    Args:
      group_sizes: i32[G].
      num_rows: M (rows past M are ignored even if the groups claim them).
      tm: row tile.
      skip_tail: give tiles past the last group's end no visit (see below).
    Returns:
      (meta, num_visits): meta i32[5, V] rows (tile, group, lo, hi, first), V = ceil(M/tm) +
      G - 1 (static bound), and num_visits, the i32 scalar count of visits in use (at least 1;
      the kernel's grid runs only these, as megablox's does):
      visit v accumulates rows [lo, hi) of M tile ``tile`` times group ``group``; ``first``
      marks a tile's first visit (zero the accumulator). Tiles that overlap no group get one
      visit with lo == hi (writes zeros), or with ``skip_tail`` none at all (tile 0 keeps one
      when no group has rows); trailing unused visits repeat the last visit's tile and group
      with lo == hi and first == 0 (no new DMAs, no compute).
    """
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_rows // tm)
    num_visits = num_tiles + num_groups - 1
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # i32[G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # i32[G]
    tile_lo = jnp.arange(num_tiles, dtype=jnp.int32)[:, None] * tm  # i32[tiles, 1]
    overlap = (ends > starts)[None, :] & (starts[None, :] < tile_lo + tm) & (ends[None, :] > tile_lo)
    num_overlap = overlap.sum(axis=1, dtype=jnp.int32)  # i32[tiles]
    count = jnp.maximum(num_overlap, 1)
    if skip_tail:  # rows [0, ends[-1]) are all in groups: tiles past that have no overlap
        live_tiles = jnp.maximum((ends[-1] + tm - 1) // tm, 1)
        count = jnp.where(tile_lo[:, 0] < live_tiles * tm, count, 0)
    incl = jnp.cumsum(count)  # i32[tiles]
    total = incl[-1]
    v = jnp.arange(num_visits, dtype=jnp.int32)
    vc = jnp.minimum(v, total - 1)
    tile = jnp.searchsorted(incl, vc, side="right").astype(jnp.int32)  # i32[V]
    j = vc - (incl[tile] - count[tile])  # index among the tile's overlapping groups
    rank = jnp.cumsum(overlap, axis=1) - 1  # i32[tiles, G]
    hit = overlap[tile] & (rank[tile] == j[:, None])  # bool[V, G]
    group = jnp.argmax(hit, axis=1).astype(jnp.int32)
    live = (v < total) & (num_overlap[tile] > 0)
    lo = jnp.where(live, starts[group], 0)
    hi = jnp.where(live, ends[group], 0)
    first = ((v < total) & (j == 0)).astype(jnp.int32)
    return jnp.stack([tile, group, lo, hi, first]), total


# --------------------------------------------------------------------------- kernel


def _gmm_kernel(
    # Prefetch (SMEM)
    layer_ref,  # i32[1] which stacked weight set (a model layer) to read
    tile_ref, group_ref, lo_ref, hi_ref, first_ref, next_ref,  # i32[V] each
    # Input
    lhs_ref,  # [tm, tk]
    *refs,  # rhs: [1, tn, tk] blocks (x2 for SwiGLU: gate, up), or with run_ahead the
    # stacked weights in HBM (once); scale f32[1, Nb, Kb] (SMEM, fp8 only)
    # Output: o_ref [tm, tn]; Scratch: acc f32[tm, tn] (x2 for SwiGLU), wdeq [tn, tk] (FP8
    # with a quantised lhs: FP8 weights alone go block by block, ``_accumulate_fp8``), with
    # run_ahead the weight slots, slot and semaphores (``gmm_weight_pipeline.scratch``)
    tm, tk, tn, num_k, num_n, swiglu, fp8, quantize, up_block, compute_dtype, run_ahead,
):
    num_rhs = 2 if swiglu else 1
    rhs_refs = refs[:1] if run_ahead else refs[:num_rhs]
    refs = refs[len(rhs_refs):]
    scale_ref = refs[0] if fp8 else None
    refs = refs[1:] if fp8 else refs
    o_ref = refs[0]
    acc_refs = refs[1 : 1 + num_rhs]
    refs = refs[1 + num_rhs:]
    wdeq_ref = refs[0] if fp8 and quantize else None
    refs = refs[1:] if fp8 and quantize else refs

    n, v, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[v], hi_ref[v]
    if run_ahead:  # this visit's weight tiles [tn, tk], fetched a run ahead
        rhs_refs = run_weights(rhs_refs[0], *refs, layer=layer_ref[0], group_ref=group_ref,
                               next_ref=next_ref, num_n=num_n, tn=tn)
    else:
        rhs_refs = [r.at[0] for r in rhs_refs]  # [tn, tk]

    @pl.when((k == 0) & (first_ref[v] == 1))
    def _zero():
        for acc in acc_refs:
            acc[...] = jnp.zeros_like(acc)

    def load_rhs(rhs_ref, out_block0):
        if not fp8:
            return rhs_ref[...].astype(compute_dtype)  # [tn, tk]
        kb0 = k * (tk // WEIGHT_BLOCK)
        for jb in range(tn // WEIGHT_BLOCK):  # dequantise per 128 x 128 block into VMEM
            for i in range(tk // WEIGHT_BLOCK):
                s = scale_ref[0, out_block0 + jb, kb0 + i]
                rs = slice(jb * WEIGHT_BLOCK, (jb + 1) * WEIGHT_BLOCK)
                cs = slice(i * WEIGHT_BLOCK, (i + 1) * WEIGHT_BLOCK)
                blk = e4m3_as_b11(rhs_ref[rs, cs]).astype(jnp.float32) * (s * B11_FACTOR)
                wdeq_ref[rs, cs] = blk.astype(compute_dtype)
        return wdeq_ref[...]

    @pl.when(hi > lo)
    def _accumulate():
        rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        in_group = (rows >= lo) & (rows < hi)  # bool[tm, 1]
        if fp8 and not quantize:
            for r, (rhs_ref, acc) in enumerate(zip(rhs_refs, acc_refs)):
                _accumulate_fp8(lhs_ref, rhs_ref, scale_ref, acc, in_group,
                                n * (tn // WEIGHT_BLOCK) + r * up_block,
                                k * (tk // WEIGHT_BLOCK), compute_dtype)
            return
        x = lhs_ref[...]
        row_scale = None
        if quantize:  # this tile is exactly one 512-wide sub-channel (or all of K)
            x, row_scale = quantize_rows(x.astype(jnp.float32))
        x = jnp.where(in_group, x, 0).astype(compute_dtype)  # [tm, tk]
        precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
        out_block0 = n * (tn // WEIGHT_BLOCK)
        for r, (rhs_ref, acc) in enumerate(zip(rhs_refs, acc_refs)):
            w = load_rhs(rhs_ref, out_block0 + r * up_block)  # [tn, tk]
            y = dot_t(x, w, preferred_element_type=jnp.float32, precision=precision)
            acc[...] += y * row_scale if quantize else y

    @pl.when(k == num_k - 1)
    def _store():
        if swiglu:
            g = acc_refs[0][...]
            y = g * jax.nn.sigmoid(g) * acc_refs[1][...]  # f32[tm, tn]
        else:
            y = acc_refs[0][...]
        o_ref[...] = y.reshape(o_ref.shape).astype(o_ref.dtype)  # row_split: [tm, P, tn/P]


def _accumulate_fp8(lhs_ref, rhs_ref, scale_ref, acc, in_group, out_block0, k_block0,
                    compute_dtype):
    """acc f32[tm, tn] += this group's rows of lhs [tm, tk] times an FP8 weight tile
    ``rhs_ref`` [tn, tk] transposed, one 128 x 128 block at a time: the block's bits read as
    e4m3b11 (exact in bf16), multiplied unscaled, and its scale (x ``B11_FACTOR``) applied to
    the f32 product [tm, 128] instead of to the block's 128 x 128 weights; rows outside the
    group are masked out of the product. No dequantised tile is stored and reloaded: the 397B
    decode gate_up step on v5e issues 9.0k bundles against 10.1k
    (``benchmarks/kernel_bundles.py``), and took 1.39 ms on the chip where the last run
    before took 1.71 ms."""
    tn, tk = rhs_ref.shape
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    for jb in range(tn // WEIGHT_BLOCK):
        cols = slice(jb * WEIGHT_BLOCK, (jb + 1) * WEIGHT_BLOCK)
        part = None
        for i in range(tk // WEIGHT_BLOCK):
            ks = slice(i * WEIGHT_BLOCK, (i + 1) * WEIGHT_BLOCK)
            w = e4m3_as_b11(rhs_ref[cols, ks]).astype(compute_dtype)  # [128, 128]
            y = dot_t(lhs_ref[:, ks].astype(compute_dtype), w,
                      preferred_element_type=jnp.float32, precision=precision)  # [tm, 128]
            y = y * (scale_ref[0, out_block0 + jb, k_block0 + i] * B11_FACTOR)
            part = y if part is None else part + y
        acc[:, cols] += jnp.where(in_group, part, 0.0)


def _gmm_pallas(lhs, rhs, group_sizes, rhs_scale, layer, quantize_lhs, out_dtype, swiglu, blocks,
                resolved, skip_tail, cost_rows, row_split):
    """rhs [Lyr, G, N, K] (scale [Lyr, G, Nb, Kb]) read at ``layer`` by the BlockSpecs: the
    stacked weights enter the kernel whole, so XLA never slices (copies) one layer out. Each
    weight tile is [tn, tk] (rows of the output, columns of the contraction), multiplied
    transposed by the MXU: no relayout of the weights anywhere."""
    m, k = lhs.shape
    num_layers, g, n_total, _ = rhs.shape
    n = n_total // 2 if swiglu else n_total  # output width
    fp8 = rhs_scale is not None
    tm, tk, tn = blocks.tm, blocks.tk, blocks.tn
    mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
    num_k, num_n = kp // tk, np_ // tn

    # Zero padding to tile multiples (none for the model's shapes). The weights are passed
    # untouched when they need none: even a no-op reshape of [G, 2N, K] into halves makes XLA
    # relay out (copy) the whole weight array, which under the layer scan is the whole stack.
    lhs_p = jnp.pad(lhs, ((0, mp - m), (0, kp - k)))  # [Mp, Kp]
    halves = 2 if swiglu else 1
    rhs_p = rhs
    if kp != k or np_ != n:
        rhs_p = rhs.reshape(num_layers, g, halves, n, k)
        rhs_p = jnp.pad(rhs_p, ((0, 0), (0, 0), (0, 0), (0, np_ - n), (0, kp - k))).reshape(
            num_layers, g, halves * np_, kp)
    if fp8:
        kb, nb = kp // WEIGHT_BLOCK, np_ // WEIGHT_BLOCK
        s = rhs_scale.astype(jnp.float32)  # f32[Lyr, G, Nb, Kb]
        s = s.reshape(num_layers, g, halves, s.shape[2] // halves, s.shape[3])
        s = jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, nb - s.shape[3]), (0, kb - s.shape[4])),
                    constant_values=1.0)
        scale_p = s.reshape(num_layers, g, halves * nb, kb)  # f32[Lyr, G, h*Np/128, Kp/128]

    # i32[5, V]; the grid runs the num_visits in use (a traced bound): with skip_tail an
    # expert-parallel step's gathered rows hold ~1/D local rows, and the visits of the rest
    # would each be a grid step of no work per N and K tile.
    meta, num_visits = make_group_metadata(group_sizes, m, tm, skip_tail=skip_tail)
    # One K tile: the weights are fetched a run of visits ahead (gmm_weight_pipeline), which
    # reads each visit's next run's group (unread otherwise: -1)
    run_ahead = num_k == 1
    nxt = next_groups(meta[1], num_visits) if run_ahead else jnp.full_like(meta[1], -1)
    meta = [*meta, nxt]
    compute_dtype = jnp.bfloat16 if quantize_lhs else (
        lhs.dtype if fp8 else jnp.promote_types(lhs.dtype, rhs.dtype))

    # index maps: (grid indices ni, vi, ki, then the prefetched layer, tile, group, ...)
    def lhs_map(ni, vi, ki, lyr, tile, *_):
        return tile[vi], ki

    def gate_map(ni, vi, ki, lyr, tile, group, *_):
        return lyr[0], group[vi], ni, ki

    def up_map(ni, vi, ki, lyr, tile, group, *_):
        return lyr[0], group[vi], ni + num_n, ki

    def scale_map(ni, vi, ki, lyr, tile, group, *_):
        return lyr[0], group[vi], 0, 0

    def out_map(ni, vi, ki, lyr, tile, *_):
        return (tile[vi], ni) if row_split is None else (tile[vi], 0, 0)  # split: one N tile

    in_specs = [pl.BlockSpec((tm, tk), lhs_map)]
    operands = [lhs_p, rhs_p]
    if run_ahead:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    else:
        in_specs.append(pl.BlockSpec((None, 1, tn, tk), gate_map))
        if swiglu:
            in_specs.append(pl.BlockSpec((None, 1, tn, tk), up_map))
            operands.append(rhs_p)
    if fp8:  # the whole group's scale table, a few hundred floats, as scalars
        in_specs.append(pl.BlockSpec((None, 1, halves * nb, kb), scale_map,
                                     memory_space=pltpu.SMEM))
        operands.append(scale_p)
    scratch = [pltpu.VMEM((tm, tn), jnp.float32) for _ in range(halves)]  # fp32 accumulators
    if fp8 and quantize_lhs:
        scratch.append(pltpu.VMEM((tn, tk), compute_dtype))  # dequantised weight tile
    if run_ahead:
        scratch += weight_scratch(halves, tn, tk, rhs.dtype)

    kernel = functools.partial(
        _gmm_kernel, tm=tm, tk=tk, tn=tn, num_k=num_k, num_n=num_n, swiglu=swiglu, fp8=fp8,
        quantize=quantize_lhs, up_block=np_ // WEIGHT_BLOCK, compute_dtype=compute_dtype,
        run_ahead=run_ahead)
    cost_fn = gmm_swiglu_cost if swiglu else gmm_cost
    cost = cost_fn(m if cost_rows is None else cost_rows, k, n, g,
                   lhs_itemsize=lhs.dtype.itemsize, rhs_itemsize=rhs.dtype.itemsize,
                   out_itemsize=jnp.dtype(out_dtype).itemsize)
    if row_split is None:
        out_block, out_shape = (tm, tn), (mp, np_)
    else:  # tn == np_ == n (checked by the caller)
        out_block, out_shape = (tm, row_split, n // row_split), (mp, row_split, n // row_split)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(num_n, num_visits, num_k),
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=gmm_vmem_limit(gmm_vmem_bytes(
                blocks, halves=halves, lhs_bytes=lhs.dtype.itemsize,
                rhs_bytes=rhs.dtype.itemsize, out_bytes=jnp.dtype(out_dtype).itemsize,
                dequant_tile=fp8 and quantize_lhs))),
        cost_estimate=cost.to_pallas(),
        interpret=dispatch.interpret_params(resolved),
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *meta, *operands)
    return out[:m, :n] if row_split is None else out[:m]


# --------------------------------------------------------------------------- public API


def _gmm_impl(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, out_dtype, impl, block_sizes, swiglu,
              layer, skip_tail=False, cost_rows=None, row_split=None):
    if layer is None:  # one weight set: view it as a stack of one
        rhs, layer = rhs[None], 0
        rhs_scale = None if rhs_scale is None else rhs_scale[None]
    elif rhs.ndim != 4:
        raise ValueError(f"with layer=, rhs must be stacked [Lyr, G, N, K], got {rhs.shape}")
    one = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731
    _validate(lhs, one(rhs), group_sizes, one(rhs_scale), quantize_lhs, swiglu=swiglu)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[2] // 2 if swiglu else rhs.shape[2]
    if row_split is not None and n % (128 * row_split):
        raise ValueError(f"row_split={row_split} needs N % (128 * row_split) == 0, got N={n}")
    resolved = dispatch.resolve(impl, has_xla=True)
    if resolved in ("xla", "reference"):
        if resolved == "xla":
            out = xla_gmm_impl(lhs, rhs, group_sizes, rhs_scale, layer, quantize_lhs, out_dtype,
                               swiglu)
        else:
            out = (ref_gmm_swiglu if swiglu else ref_gmm)(
                lhs, rhs[layer], group_sizes,
                rhs_scale=None if rhs_scale is None else rhs_scale[layer],
                quantize_lhs=quantize_lhs, out_dtype=out_dtype)
        return out if row_split is None else out.reshape(m, row_split, n // row_split)
    blocks = block_sizes or _table_blocks(m, k, n, quantize_lhs)
    if row_split is not None:  # one N tile: a row's [P, N/P] slab is written whole
        blocks = dataclasses.replace(blocks, tn=n)
    _validate_blocks(blocks, k, quantize_lhs)
    if m == 0:
        return jnp.zeros((0, n) if row_split is None else (0, row_split, n // row_split),
                         out_dtype)
    return _gmm_pallas(lhs, rhs, group_sizes, rhs_scale, layer, quantize_lhs, out_dtype, swiglu,
                       blocks, resolved, skip_tail, cost_rows, row_split)


def gmm(lhs, rhs, group_sizes, *, rhs_scale=None, quantize_lhs=False, out_dtype=None, impl=None,
        block_sizes: GmmBlockSizes | None = None, layer=None, skip_tail: bool = False,
        cost_rows: int | None = None, row_split: int | None = None):
    """Grouped matmul: ``out[r] = lhs[r] @ w[group(r)].T``, fp32 accumulation.

    Args:
      lhs: [M, K] bf16/f32, rows sorted by group.
      rhs: [G, N, K] bf16/f32 (each group's weights [out, in], as checkpoints store them), or
        float8_e4m3fn with ``rhs_scale``.
      group_sizes: i32[G]; empty groups allowed; rows past the sum give zeros.
      rhs_scale: f32[G, ceil(N/128), ceil(K/128)] block scales for FP8 ``rhs`` (the
        checkpoints' ``weight_scale_inv``).
      quantize_lhs: FP8 only; quantise lhs to e4m3 per row per 512-wide K sub-channel.
      out_dtype: defaults to lhs.dtype.
      impl: see ``kernels/dispatch.py`` (static under jit).
      block_sizes: tile override for the Pallas path (the XLA path tiles rows by
        ``XLA_TILE_ROWS``).
      layer: optional int or traced i32 scalar; then ``rhs`` is a stack [Lyr, G, N, K] (scale
        [Lyr, G, ...]) of one weight set per model layer and ``rhs[layer]`` is used. The Pallas
        path reads it in place (no XLA slice of the stack, which under a layer scan copies).
      skip_tail: the Pallas kernel leaves rows past ``sum(group_sizes)`` unwritten (their
        content is unspecified) instead of zeroing them, and reads none of their lhs tiles.
      cost_rows: rows the Pallas ``CostEstimate`` charges (static; default M): the rows the
        caller expects the groups to hold, for a ``skip_tail`` call whose groups cover only
        part of M (an expert-parallel device's share of the gathered rows).
      row_split: P; return [M, P, N/P] instead of [M, N]. On TPU each row is then one
        contiguous whole-tile [P, N/P] slab in HBM, the view ``routing.gather_reduce`` DMAs
        rows from, so no relayout copy of the output sits between the two (the kernel then
        computes full-width tiles, tn = N). Needs N % (128 P) == 0.
    Returns:
      [M, N] (or [M, P, N/P]) in out_dtype.
    """
    return _gmm_impl(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, out_dtype, impl,
                     block_sizes, swiglu=False, layer=layer, skip_tail=skip_tail,
                     cost_rows=cost_rows, row_split=row_split)


def gmm_swiglu(lhs, rhs, group_sizes, *, rhs_scale=None, quantize_lhs=False, out_dtype=None,
               impl=None, block_sizes: GmmBlockSizes | None = None, layer=None,
               skip_tail: bool = False, cost_rows: int | None = None):
    """Grouped ``silu(lhs @ gate.T) * (lhs @ up.T)`` with gate and up tiles in one kernel pass.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, 2N, K], rows ``[gate (N) | up (N)]`` (a checkpoint's gate_proj and up_proj
        [N, K] stacked); FP8 needs N % 128 == 0.
      group_sizes, rhs_scale, quantize_lhs, out_dtype, impl, block_sizes, layer, skip_tail,
        cost_rows: as :func:`gmm` (``rhs_scale`` is f32[G, 2N/128, ceil(K/128)]).
    Returns:
      [M, N] in out_dtype; the activation is computed in fp32 inside the kernel.
    """
    return _gmm_impl(lhs, rhs, group_sizes, rhs_scale, quantize_lhs, out_dtype, impl,
                     block_sizes, swiglu=True, layer=layer, skip_tail=skip_tail,
                     cost_rows=cost_rows)


# --------------------------------------------------------------------------- cost


def gmm_cost(m: int, k: int, n: int, num_groups: int, *, lhs_itemsize: int = 2,
             rhs_itemsize: int = 2, out_itemsize: int = 2) -> Cost:
    """[M, K] x [G, N, K] grouped matmul: 2MKN FLOPs; lhs, all weights (+ FP8 scales), out once."""
    scale_bytes = 4 * num_groups * -(-k // WEIGHT_BLOCK) * -(-n // WEIGHT_BLOCK) if rhs_itemsize == 1 else 0
    return Cost(
        flops=2 * m * k * n,
        bytes_accessed=m * k * lhs_itemsize + num_groups * k * n * rhs_itemsize + scale_bytes
        + m * n * out_itemsize,
    )


def gmm_swiglu_cost(m: int, k: int, n: int, num_groups: int, *, lhs_itemsize: int = 2,
                    rhs_itemsize: int = 2, out_itemsize: int = 2) -> Cost:
    """[M, K] x [G, 2N, K] then silu(gate) * up -> [M, N] (n is the output width)."""
    mm = gmm_cost(m, k, 2 * n, num_groups, lhs_itemsize=lhs_itemsize, rhs_itemsize=rhs_itemsize,
                  out_itemsize=0)
    return Cost(flops=mm.flops + 4 * m * n, bytes_accessed=mm.bytes_accessed + m * n * out_itemsize,
                transcendentals=m * n)
