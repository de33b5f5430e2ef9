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

Pallas kernel (megablox-style): grid ``(N tiles, visits, K tiles)``. A *visit* is one
(M tile, group) pair whose row ranges overlap; the visit list is computed in the wrapper
and scalar-prefetched, so an M tile is visited once per group it overlaps (at least once,
so tiles past the last group still write zeros; with ``skip_tail`` they get no visit). Rows
of other groups are masked to zero in the lhs tile. One fp32 accumulator per M tile lives
in VMEM across its visits.

XLA path (``impl="xla"``, what ``"auto"`` picks off-TPU): the same visit idea in plain XLA.
The sorted rows are cut into tiles (``xla_tile_rows``) that each belong to one group; a loop
over the tiles in use multiplies each tile's rows by its group's weights, sliced out of the
stack (no gathered copy of every tile's weights), and each row reads its result back. The
reference (one masked dense matmul per group over all M rows) stays the obvious oracle.

TPU assumptions: tiles tm x tk x tn with tm a multiple of 16 and tk, tn multiples of 128
(defaults 128 x 512 x 512: for the model's K=4096, N=1024 the weight tiles [tn, tk] are
512 KiB in bf16, 256 KiB in fp8, well inside the default scoped VMEM). Shapes that are not tile
multiples are zero-padded by the wrapper (never the case for the model's K and N).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import dispatch
from .cost import Cost

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHT_BLOCK = 128  # rhs_scale block (K and N)
LHS_QUANT_BLOCK = 512  # activation quantisation sub-channel width along K


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


def default_block_sizes(m: int, k: int, n: int, *, quantize_lhs: bool = False) -> GmmBlockSizes:
    """Tiles for an [m, k] x [n, k]^T problem (n = one half's width for SwiGLU)."""
    tm = min(128, _round_up(max(m, 1), 16))
    if quantize_lhs:
        tk = min(LHS_QUANT_BLOCK, _round_up(k, 128))  # one tile = one 512 sub-channel
    else:
        tk = _largest_dividing_tile(k, 512)
    return GmmBlockSizes(tm=tm, tk=tk, tn=_largest_dividing_tile(n, 512))


# --------------------------------------------------------------------------- reference


def quantize_fp8_blockwise(w, block: int = WEIGHT_BLOCK):
    """Block-wise e4m3 quantisation of expert weights (blocks over the last two axes).

    Args:
      w: float[G, N, K] (any [G, rows, cols]).
      block: square block size (128 in the checkpoints).
    Returns:
      (w_fp8 float8_e4m3fn[G, N, K], scale f32[G, ceil(N/block), ceil(K/block)]) with
      ``w ~= w_fp8 * scale[:, n // block, k // block]``; scale = block amax / 448 (1 for an
      all-zero block), values rounded as ``w * (1 / scale)``.
    """
    if w.ndim != 3:
        raise ValueError(f"w must be [G, N, K], got shape {w.shape}")
    g, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    w32 = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, nb * block - n), (0, kb * block - k)))
    blocks = w32.reshape(g, nb, block, kb, block)  # f32[G, Nb, b, Kb, b]
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4))  # f32[G, Nb, Kb]
    scale = _fp8_scale(amax)
    inv = (1.0 / scale)[:, :, None, :, None]
    q = jnp.clip(blocks * inv, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    q = q.reshape(g, nb * block, kb * block)[:, :n, :k]
    return q, scale


def dequantize_fp8_blockwise(w_fp8, scale, block: int = WEIGHT_BLOCK):
    """f32[G, N, K] = w_fp8 * scale expanded over block x block tiles."""
    _, n, k = w_fp8.shape
    s = jnp.repeat(jnp.repeat(scale, block, axis=1), block, axis=2)[:, :n, :k]
    return w_fp8.astype(jnp.float32) * s


def _fp8_scale(amax):
    """amax / 448 as ``amax * f32(1/448)`` (1 where amax == 0).

    Quantisation multiplies by ``1 / scale`` rather than dividing: XLA rewrites a division by
    a broadcast into that anyway, and spelling it out makes the e4m3 rounding reproducible
    bit for bit (numpy simulation, reference and kernel agree on ties).
    """
    return jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), 1.0).astype(jnp.float32)


def _quantize_rows(x32):
    """Per-row e4m3 quantisation of x32 f32[..., C] over its last axis -> (q f32, scale f32[..., 1])."""
    scale = _fp8_scale(jnp.max(jnp.abs(x32), axis=-1, keepdims=True))
    q = jnp.clip(x32 * (1.0 / scale), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).astype(jnp.float32)
    return q, scale


def quantize_lhs_reference(lhs):
    """lhs quantised per row per 512-wide K sub-channel and dequantised: f32[M, K]."""
    m, k = lhs.shape
    kq = -(-k // LHS_QUANT_BLOCK)
    x = jnp.pad(lhs.astype(jnp.float32), ((0, 0), (0, kq * LHS_QUANT_BLOCK - k)))
    q, s = _quantize_rows(x.reshape(m, kq, LHS_QUANT_BLOCK))  # f32[M, Kq, 512], f32[M, Kq, 1]
    return (q * s).reshape(m, kq * LHS_QUANT_BLOCK)[:, :k]


def _ref_dense_inputs(lhs, rhs, rhs_scale, quantize_lhs):
    x = quantize_lhs_reference(lhs) if quantize_lhs else lhs.astype(jnp.float32)
    if rhs_scale is not None:
        w = dequantize_fp8_blockwise(rhs, rhs_scale)
    else:
        w = rhs.astype(jnp.float32)
    return x, w  # f32[M, K], f32[G, N, K]


def _dot_t(x, w, **kwargs):
    """x [M, K] times w [N, K] transposed -> [M, N]: contracts both operands' last axes."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), **kwargs)


def _ref_grouped(x, w, group_sizes):
    """f32[M, N]: rows of group g times w[g].T; rows past the groups are zero."""
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # i32[G]
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")  # i32[M]
    out = jnp.zeros((m, w.shape[1]), jnp.float32)
    for g in range(w.shape[0]):  # one masked dense matmul per group (reference only)
        y = _dot_t(x, w[g], precision=jax.lax.Precision.HIGHEST)
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


# --------------------------------------------------------------------------- XLA (off-TPU)

# Rows per tile of the XLA path (the floor: larger M grows it, see ``xla_tile_rows``). Each
# tile copies its group's [N, K] weights out of the stack (XLA:CPU materialises a dynamic
# slice before a dot; the copy lands in cache, where the dot reads it) and multiplies all its
# rows, padding included. At decode sizes XLA:CPU's dot costs more with more rows even with
# the weights in cache, so tiles should be no larger than the groups they hold: decode has
# ~M/G rows per expert (8 at 64 rows x top-8 over 64 experts, 4 at 32), prefill wants few
# tiles per group. benchmarks/bench_cpu_moe.py sweeps it (--tm).
XLA_TILE_ROWS = 8
XLA_MAX_TILE_ROWS = 128


def xla_tile_rows(num_rows: int, num_groups: int, floor: int | None = None) -> int:
    """Tile rows for M rows over G groups: the power of two >= M/G (the mean group), clamped
    to [``XLA_TILE_ROWS``, ``XLA_MAX_TILE_ROWS``]."""
    floor = floor or XLA_TILE_ROWS
    mean = -(-num_rows // max(num_groups, 1))
    return max(floor, min(XLA_MAX_TILE_ROWS, 1 << max(mean - 1, 0).bit_length()))


def xla_tile_plan(group_sizes, num_rows: int, tm: int = XLA_TILE_ROWS):
    """Split the sorted rows into tiles of ``tm`` rows that each belong to one group.

    Args:
      group_sizes: i32[G]; groups past ``num_rows`` rows are cut there.
      num_rows: M.
      tm: rows per tile.
    Returns:
      (tile_group i32[S], tile_rows i32[S, tm], row_slot i32[M]) with the static tile count
      S = min(ceil(M/tm) + G, (M + min(G, M) * (tm - 1)) // tm), an upper bound of
      sum_g ceil(size_g / tm). Tile s holds rows ``tile_rows[s]`` of group ``tile_group[s]``;
      slots past the group's end and unused tiles hold row index M (out of range). Row r sits
      at flat slot ``row_slot[r]`` (tile * tm + offset) of the tiles, or -1 outside the groups.
    """
    num_groups = group_sizes.shape[0]
    num_tiles = max(1, min(-(-num_rows // tm) + num_groups,
                           (num_rows + min(num_groups, num_rows) * (tm - 1)) // tm))
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # i32[G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # i32[G]
    count = (ends - starts + tm - 1) // tm  # i32[G] tiles per group
    tiles_end = jnp.cumsum(count)  # i32[G]
    s = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tiles_end, s, side="right"), num_groups - 1)
    group = group.astype(jnp.int32)  # unused tiles (s >= total) land on the last group
    first_row = starts[group] + (s - (tiles_end[group] - count[group])) * tm  # i32[S]
    rows = first_row[:, None] + jnp.arange(tm, dtype=jnp.int32)[None, :]  # i32[S, tm]
    used = (s < tiles_end[-1])[:, None] & (rows < ends[group][:, None])
    rows = jnp.where(used, rows, num_rows)

    r = jnp.arange(num_rows, dtype=jnp.int32)
    g_of_r = jnp.minimum(jnp.searchsorted(ends, r, side="right"), num_groups - 1)  # i32[M]
    local = r - starts[g_of_r]
    slot = (tiles_end[g_of_r] - count[g_of_r] + local // tm) * tm + local % tm
    row_slot = jnp.where(r < ends[-1], slot, -1).astype(jnp.int32)
    return group, rows, row_slot


def _xla_grouped(x, rhs, rhs_scale, layer, group_sizes, swiglu, tm):
    """f32[M, N]: the tiled grouped matmul (``silu(gate) * up`` per tile for SwiGLU).

    x [M, K] (f32, or bf16 when lhs and weights are bf16); rhs [Lyr, G, N', K] (N' = 2N for
    SwiGLU) and rhs_scale f32[Lyr, G, Nb', Kb] or None, read at ``layer``. A loop over the
    tiles the groups use (a traced trip count: sum_g ceil(size_g / tm)) gathers each tile's
    rows [tm, K], slices its group's weights [N', K] out of the stack in their stored dtype
    (FP8 dequantised to f32 after the slice, so only the weights the tiles use are
    converted) and multiplies with fp32 accumulation; each row then picks its tile slot back.
    One pass over a group's weights per tile: about ``M * K * N`` FLOPs and
    (tiles x K x N) weight reads, and no [tiles, K, N] gathered copy in memory. Products of
    bf16 values are exact in fp32, so bf16 operands give the reference's fp32 math.
    """
    m, k = x.shape
    tile_group, tile_rows, row_slot = xla_tile_plan(group_sizes, m, tm)
    num_tiles, width = tile_group.shape[0], rhs.shape[2]
    n = width // 2 if swiglu else width
    used = jnp.sum((jnp.minimum(group_sizes, m) + tm - 1) // tm)  # tiles holding rows

    def tile(s, out):
        g = tile_group[s]
        w = jax.lax.dynamic_slice(rhs, (layer, g, 0, 0), (1, 1, width, k))[0, 0]  # [N', K]
        if rhs_scale is not None:
            sc = jax.lax.dynamic_slice(rhs_scale, (layer, g, 0, 0),
                                       (1, 1, *rhs_scale.shape[2:]))[0, 0]  # f32[Nb', Kb]
            sc = jnp.repeat(jnp.repeat(sc, WEIGHT_BLOCK, axis=0), WEIGHT_BLOCK, axis=1)
            w = w.astype(jnp.float32) * sc[:width, :k]  # as dequantize_fp8_blockwise
        w = w.astype(x.dtype)  # no-op unless f32 activations meet bf16 weights
        xt = jnp.take(x, tile_rows[s], axis=0, mode="fill", fill_value=0)  # [tm, K]
        y = _dot_t(xt, w, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)  # f32[tm, N']
        if swiglu:
            y = jax.nn.silu(y[:, :n]) * y[:, n:]
        return jax.lax.dynamic_update_slice(out, y, (s * tm, 0))

    y = jax.lax.fori_loop(0, used, tile, jnp.zeros((num_tiles * tm, n), jnp.float32))
    return jnp.where((row_slot >= 0)[:, None], y[jnp.maximum(row_slot, 0)], 0.0)


def xla_gmm_impl(lhs, rhs, group_sizes, rhs_scale, layer, quantize_lhs, out_dtype, swiglu,
                 tm: int | None = None):
    """The XLA path of :func:`gmm` / :func:`gmm_swiglu` with stacked ``rhs`` [Lyr, G, N, K].

    Same fp32 math as the reference (activations quantised the same way with
    ``quantize_lhs``), but only each row's own group is computed: about ``M * K * N`` FLOPs
    plus (tiles x K x N) weight reads instead of the reference's ``G * M * K * N``.
    """
    m = lhs.shape[0]
    n = rhs.shape[2] // 2 if swiglu else rhs.shape[2]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    tm = tm or xla_tile_rows(m, rhs.shape[1])  # read at trace time: a benchmark sweeps it
    if quantize_lhs or rhs_scale is not None:
        x = quantize_lhs_reference(lhs) if quantize_lhs else lhs.astype(jnp.float32)
    else:  # bf16 x bf16 stays bf16 (exact products, fp32 sums); anything else in fp32
        both_bf16 = lhs.dtype == rhs.dtype == jnp.bfloat16
        x = lhs if both_bf16 else lhs.astype(jnp.float32)
    return _xla_grouped(x, rhs, rhs_scale, layer, group_sizes, swiglu, tm).astype(out_dtype)


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


def _validate_blocks(b: GmmBlockSizes, k: int, quantize_lhs: bool):
    if b.tm % 16 or b.tm <= 0 or b.tk % 128 or b.tk <= 0 or b.tn % 128 or b.tn <= 0:
        raise ValueError(f"block sizes must be tm % 16 == 0, tk % 128 == 0, tn % 128 == 0: {b}")
    if quantize_lhs and b.tk != min(LHS_QUANT_BLOCK, _round_up(k, 128)):
        raise ValueError(
            f"quantize_lhs needs tk == min(512, round_up(K, 128)) = "
            f"{min(LHS_QUANT_BLOCK, _round_up(k, 128))} (one sub-channel per tile), got {b.tk}")


# --------------------------------------------------------------------------- metadata


def make_group_metadata(group_sizes, num_rows: int, tm: int, *, skip_tail: bool = False):
    """Visit list for the kernel grid: one visit per (M tile, overlapping non-empty group).

    Args:
      group_sizes: i32[G].
      num_rows: M (rows past M are ignored even if the groups claim them).
      tm: row tile.
      skip_tail: give tiles past the last group's end no visit (see below).
    Returns:
      i32[5, V] rows (tile, group, lo, hi, first), V = ceil(M/tm) + G - 1 (static bound):
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
    return jnp.stack([tile, group, lo, hi, first])


# --------------------------------------------------------------------------- kernel


def _gmm_kernel(
    # Prefetch (SMEM)
    layer_ref,  # i32[1] which stacked weight set (a model layer) to read
    tile_ref, group_ref, lo_ref, hi_ref, first_ref,  # i32[V] each
    # Input
    lhs_ref,  # [tm, tk]
    *refs,  # rhs [1, tn, tk] (x2 for SwiGLU: gate, up), scale f32[1, Nb, Kb] (SMEM, fp8 only)
    # Output: o_ref [tm, tn]; Scratch: acc f32[tm, tn] (x2 for SwiGLU), wdeq [tn, tk] (fp8)
    tm, tk, tn, num_k, swiglu, fp8, quantize, up_block, compute_dtype,
):
    num_rhs = 2 if swiglu else 1
    rhs_refs = refs[:num_rhs]
    refs = refs[num_rhs:]
    scale_ref = refs[0] if fp8 else None
    refs = refs[1:] if fp8 else refs
    o_ref = refs[0]
    acc_refs = refs[1 : 1 + num_rhs]
    wdeq_ref = refs[1 + num_rhs] if fp8 else None

    n, v, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[v], hi_ref[v]

    @pl.when((k == 0) & (first_ref[v] == 1))
    def _zero():
        for acc in acc_refs:
            acc[...] = jnp.zeros_like(acc)

    def load_rhs(rhs_ref, out_block0):
        if not fp8:
            return rhs_ref[0].astype(compute_dtype)  # [tn, tk]
        kb0 = k * (tk // WEIGHT_BLOCK)
        for jb in range(tn // WEIGHT_BLOCK):  # dequantise per 128 x 128 block into VMEM
            for i in range(tk // WEIGHT_BLOCK):
                s = scale_ref[0, out_block0 + jb, kb0 + i]
                rs = slice(jb * WEIGHT_BLOCK, (jb + 1) * WEIGHT_BLOCK)
                cs = slice(i * WEIGHT_BLOCK, (i + 1) * WEIGHT_BLOCK)
                blk = rhs_ref[0, rs, cs].astype(jnp.float32) * s
                wdeq_ref[rs, cs] = blk.astype(compute_dtype)
        return wdeq_ref[...]

    @pl.when(hi > lo)
    def _accumulate():
        rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        in_group = (rows >= lo) & (rows < hi)  # bool[tm, 1]
        x = lhs_ref[...]
        row_scale = None
        if quantize:  # this tile is exactly one 512-wide sub-channel (or all of K)
            x, row_scale = _quantize_rows(x.astype(jnp.float32))
        x = jnp.where(in_group, x, 0).astype(compute_dtype)  # [tm, tk]
        precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
        out_block0 = n * (tn // WEIGHT_BLOCK)
        for r, (rhs_ref, acc) in enumerate(zip(rhs_refs, acc_refs)):
            w = load_rhs(rhs_ref, out_block0 + r * up_block)  # [tn, tk]
            y = _dot_t(x, w, preferred_element_type=jnp.float32, precision=precision)
            acc[...] += y * row_scale if quantize else y

    @pl.when(k == num_k - 1)
    def _store():
        if swiglu:
            g = acc_refs[0][...]
            y = g * jax.nn.sigmoid(g) * acc_refs[1][...]  # f32[tm, tn]
        else:
            y = acc_refs[0][...]
        o_ref[...] = y.reshape(o_ref.shape).astype(o_ref.dtype)  # row_split: [tm, P, tn/P]


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

    meta = make_group_metadata(group_sizes, m, tm, skip_tail=skip_tail)  # i32[5, V]
    num_visits = meta.shape[1]
    compute_dtype = jnp.bfloat16 if quantize_lhs else (
        lhs.dtype if fp8 else jnp.promote_types(lhs.dtype, rhs.dtype))

    def lhs_map(ni, vi, ki, lyr, tile, group, lo, hi, first):
        return tile[vi], ki

    def gate_map(ni, vi, ki, lyr, tile, group, lo, hi, first):
        return lyr[0], group[vi], ni, ki

    def up_map(ni, vi, ki, lyr, tile, group, lo, hi, first):
        return lyr[0], group[vi], ni + num_n, ki

    def scale_map(ni, vi, ki, lyr, tile, group, lo, hi, first):
        return lyr[0], group[vi], 0, 0

    def out_map(ni, vi, ki, lyr, tile, group, lo, hi, first):
        return (tile[vi], ni) if row_split is None else (tile[vi], 0, 0)  # split: one N tile

    in_specs = [pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((None, 1, tn, tk), gate_map)]
    operands = [lhs_p, rhs_p]
    if swiglu:
        in_specs.append(pl.BlockSpec((None, 1, tn, tk), up_map))
        operands.append(rhs_p)
    if fp8:  # the whole group's scale table, a few hundred floats, as scalars
        in_specs.append(pl.BlockSpec((None, 1, halves * nb, kb), scale_map,
                                     memory_space=pltpu.SMEM))
        operands.append(scale_p)
    scratch = [pltpu.VMEM((tm, tn), jnp.float32) for _ in range(halves)]  # fp32 accumulators
    if fp8:
        scratch.append(pltpu.VMEM((tn, tk), compute_dtype))  # dequantised weight tile

    kernel = functools.partial(
        _gmm_kernel, tm=tm, tk=tk, tn=tn, num_k=num_k, swiglu=swiglu, fp8=fp8,
        quantize=quantize_lhs, up_block=np_ // WEIGHT_BLOCK, compute_dtype=compute_dtype)
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
            num_scalar_prefetch=6,
            grid=(num_n, num_visits, num_k),
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
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
    blocks = block_sizes or default_block_sizes(m, k, n, quantize_lhs=quantize_lhs)
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
