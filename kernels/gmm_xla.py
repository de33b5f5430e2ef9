"""The grouped matmul's XLA path (``impl="xla"``, what ``"auto"`` picks off a TPU; ``gmm.py``
describes the contract): the sorted rows cut into tiles of one group each, a loop over the
tiles in use multiplying each tile by its group's weights sliced out of the stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .gmm_quant import WEIGHT_BLOCK, quantize_lhs_reference


def dot_t(x, w, **kwargs):
    """x [M, K] times w [N, K] transposed -> [M, N]: contracts both operands' last axes."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), **kwargs)


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
        y = dot_t(xt, w, preferred_element_type=jnp.float32,
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
