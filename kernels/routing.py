"""MoE routing: sort assignments by local expert, gather token rows, weighted gather-reduce.

Dimension letters: T tokens, k top-k slots, E local experts, M = T*k sorted assignments,
H hidden.

Flow on one expert-parallel device (DESIGN.md section 3):
  token_idx, group_sizes, rows = route_metadata(topk_ids, E, expert_offset=...)
  xs = gather_rows(x, token_idx)                     # [M, H], local assignments first
  ys = gmm(... xs ..., group_sizes)                  # expert outputs in sorted order
  out = gather_reduce(ys, rows, topk_weights)        # [T, H], per-token weighted sum

Both data movers are index-driven Pallas kernels: the indices are scalar-prefetched into
SMEM and each needed row is DMA'd from HBM (``pl.ANY``) into a VMEM block, with up to
``NUM_INFLIGHT`` row copies outstanding; no one-hot or padded permutation matrix exists.
The index arrays live whole in SMEM, which bounds them to tens of thousands of entries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch
from kernels.cost import Cost

NUM_INFLIGHT = 8  # row DMAs kept in flight per kernel step


@dataclasses.dataclass(frozen=True)
class RoutingBlockSizes:
    """Rows per grid step: gather output rows, and tokens per gather-reduce step."""

    gather_rows: int = 128
    reduce_tokens: int = 32


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# --------------------------------------------------------------------------- metadata


def route_metadata(topk_ids, num_experts: int, *, expert_offset=0):
    """Sort (token, slot) assignments by local expert (plain jnp, jit-able).

    Args:
      topk_ids: i32[T, k] global expert id per assignment.
      num_experts: number of experts on this device (static).
      expert_offset: global id of the first local expert (may be traced).
    Returns:
      token_idx i32[T*k]: source token of each sorted assignment, local ones first grouped by
        expert (stable in (t, j) order), tail -1.
      group_sizes i32[num_experts].
      rows i32[T, k]: sorted position of assignment (t, j), -1 if not local.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {topk_ids.shape}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    t, k = topk_ids.shape
    local = topk_ids.reshape(-1).astype(jnp.int32) - expert_offset  # i32[M]
    is_local = (local >= 0) & (local < num_experts)
    key = jnp.where(is_local, local, num_experts)  # non-local sort last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # i32[M]: sorted -> flat (t*k + j)
    token_idx = jnp.where(key[order] < num_experts, order // k, -1)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    position = jnp.zeros((t * k,), jnp.int32).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    rows = jnp.where(is_local, position, -1).reshape(t, k)
    return token_idx, group_sizes, rows


# --------------------------------------------------------------------------- references


def ref_gather_rows(x, token_idx):
    """out[i] = x[token_idx[i]], zero where token_idx[i] < 0.  [T, H], i32[M] -> [M, H]."""
    _validate_gather(x, token_idx)
    valid = token_idx >= 0
    return jnp.where(valid[:, None], x[jnp.where(valid, token_idx, 0)], 0).astype(x.dtype)


def ref_gather_reduce(y, rows, weights):
    """out[t] = sum_j weights[t, j] * y[rows[t, j]] over rows >= 0, fp32 sum, y.dtype out."""
    _validate_reduce(y, rows, weights)
    valid = rows >= 0  # bool[T, k]
    picked = y[jnp.where(valid, rows, 0)].astype(jnp.float32)  # f32[T, k, H]
    w = jnp.where(valid, weights.astype(jnp.float32), 0.0)  # f32[T, k]
    return jnp.einsum("tk,tkh->th", w, picked, precision=jax.lax.Precision.HIGHEST).astype(y.dtype)


# --------------------------------------------------------------------------- validation


def _validate_gather(x, token_idx):
    if x.ndim != 2 or token_idx.ndim != 1:
        raise ValueError(f"gather_rows needs x [T, H] and token_idx [M]; got {x.shape}, {token_idx.shape}")
    if not jnp.issubdtype(token_idx.dtype, jnp.integer):
        raise ValueError(f"token_idx must be integer, got {token_idx.dtype}")


def _validate_reduce(y, rows, weights):
    if y.ndim != 2 or rows.ndim != 2 or weights.shape != rows.shape:
        raise ValueError(
            f"gather_reduce needs y [M, H], rows [T, k], weights [T, k]; got {y.shape}, "
            f"{rows.shape}, {weights.shape}")
    if not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be integer, got {rows.dtype}")


# --------------------------------------------------------------------------- kernels


def _copy_rows(src_hbm, index_of, dst_of, num, sem):
    """DMA ``src_hbm[index_of(i)]`` -> ``dst_of(i)`` for i < num, NUM_INFLIGHT copies in flight.

    Rows whose index is negative are skipped (their destination keeps stale data; callers
    mask them). Slot ``i % NUM_INFLIGHT`` of ``sem`` tracks copy i.
    """

    def copy(i, idx):
        return pltpu.make_async_copy(src_hbm.at[pl.ds(idx, 1)], dst_of(i), sem.at[i % NUM_INFLIGHT])

    def body(i, carry):
        @pl.when(i >= NUM_INFLIGHT)
        def _retire():  # wait for the copy that used this slot before reusing it
            prev = i - NUM_INFLIGHT

            @pl.when(index_of(prev) >= 0)
            def _():
                copy(prev, 0).wait()

        idx = index_of(i)

        @pl.when(idx >= 0)
        def _():
            copy(i, idx).start()

        return carry

    jax.lax.fori_loop(0, num, body, 0)

    def drain(i, carry):
        @pl.when(index_of(i) >= 0)
        def _():
            copy(i, 0).wait()

        return carry

    jax.lax.fori_loop(max(num - NUM_INFLIGHT, 0), num, drain, 0)


def _gather_rows_kernel(
    idx_ref,  # Prefetch: i32[Mp] source rows
    idx_blk_ref,  # Input: i32[bm, 1] the same indices, as a vector for masking
    x_hbm,  # Input: [T, H] in HBM (pl.ANY)
    o_ref,  # Output: [bm, H]
    sem,  # Scratch: DMA semaphores[NUM_INFLIGHT]
    *, bm,
):
    base = pl.program_id(0) * bm
    _copy_rows(x_hbm, lambda i: idx_ref[base + i], lambda i: o_ref.at[pl.ds(i, 1)], bm, sem)
    o_ref[...] = jnp.where(idx_blk_ref[...] >= 0, o_ref[...], 0).astype(o_ref.dtype)


def _gather_reduce_kernel(
    rows_ref,  # Prefetch: i32[Tp * k] sorted row of each (token, slot)
    rows_blk_ref,  # Input: i32[bt, k] the same rows, as vectors for masking
    w_ref,  # Input: f32[bt, k] routing weights
    y_hbm,  # Input: [M, H] in HBM (pl.ANY)
    o_ref,  # Output: [bt, H]
    buf,  # Scratch: [k, bt, H] gathered expert rows, slot-major
    sem,  # Scratch: DMA semaphores[NUM_INFLIGHT]
    *, bt, k,
):
    base = pl.program_id(0) * bt * k
    _copy_rows(
        y_hbm,
        lambda i: rows_ref[base + i],
        lambda i: buf.at[i % k].at[pl.ds(i // k, 1)],
        bt * k,
        sem,
    )
    valid = rows_blk_ref[...] >= 0  # bool[bt, k]
    w = w_ref[...].astype(jnp.float32)  # f32[bt, k]
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(k):
        contrib = w[:, j : j + 1] * buf[j].astype(jnp.float32)  # f32[bt, H]
        acc += jnp.where(valid[:, j : j + 1], contrib, 0.0)  # skipped slots hold stale data
    o_ref[...] = acc.astype(o_ref.dtype)


# --------------------------------------------------------------------------- public API


def gather_rows(x, token_idx, *, impl=None, block_sizes: RoutingBlockSizes | None = None):
    """Gather token rows into sorted-assignment order.

    Args:
      x: [T, H] token hidden states.
      token_idx: i32[M] source row per output row; entries < 0 give zero rows.
      impl: see :mod:`kernels.dispatch` (static under jit).
    Returns:
      [M, H] in x.dtype.
    """
    _validate_gather(x, token_idx)
    resolved = dispatch.resolve(impl)
    if resolved == "reference" or token_idx.shape[0] == 0:
        return ref_gather_rows(x, token_idx)
    m, (t, h) = token_idx.shape[0], x.shape
    bm = min((block_sizes or RoutingBlockSizes()).gather_rows, _round_up(m, 16))
    mp = _round_up(m, bm)
    idx = token_idx.astype(jnp.int32)
    idx = jnp.where(idx < t, idx, -1)  # out-of-range rows read nothing (zeros)
    idx = jnp.pad(idx, (0, mp - m), constant_values=-1)  # i32[Mp]
    out = pl.pallas_call(
        functools.partial(_gather_rows_kernel, bm=bm),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(mp // bm,),
            in_specs=[
                pl.BlockSpec((bm, 1), lambda i, idx_ref: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((bm, h), lambda i, idx_ref: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA((NUM_INFLIGHT,))],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, h), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=gather_rows_cost(m, h, itemsize=x.dtype.itemsize).to_pallas(),
        interpret=dispatch.interpret_params(resolved),
    )(idx, idx[:, None], x)
    return out[:m]


def gather_reduce(y, rows, weights, *, impl=None, block_sizes: RoutingBlockSizes | None = None):
    """Weighted un-permute: ``out[t] = sum_j weights[t, j] * y[rows[t, j]]`` over rows >= 0.

    Args:
      y: [M, H] expert outputs in sorted-assignment order.
      rows: i32[T, k] from :func:`route_metadata` (-1 = not local, skipped).
      weights: f32[T, k] routing weights.
      impl: see :mod:`kernels.dispatch` (static under jit).
    Returns:
      [T, H] in y.dtype, summed in fp32.
    """
    _validate_reduce(y, rows, weights)
    resolved = dispatch.resolve(impl)
    t, k = rows.shape
    if resolved == "reference" or t == 0 or k == 0:
        return ref_gather_reduce(y, rows, weights)
    m, h = y.shape
    bt = min((block_sizes or RoutingBlockSizes()).reduce_tokens, _round_up(t, 8))
    tp = _round_up(t, bt)
    r = rows.astype(jnp.int32)
    r = jnp.pad(jnp.where(r < m, r, -1), ((0, tp - t), (0, 0)), constant_values=-1)  # i32[Tp, k]
    w = jnp.pad(weights.astype(jnp.float32), ((0, tp - t), (0, 0)))  # f32[Tp, k]
    out = pl.pallas_call(
        functools.partial(_gather_reduce_kernel, bt=bt, k=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tp // bt,),
            in_specs=[
                pl.BlockSpec((bt, k), lambda i, rows_ref: (i, 0)),
                pl.BlockSpec((bt, k), lambda i, rows_ref: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((bt, h), lambda i, rows_ref: (i, 0)),
            scratch_shapes=[
                pltpu.VMEM((k, bt, h), y.dtype),  # gathered rows of this token block
                pltpu.SemaphoreType.DMA((NUM_INFLIGHT,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((tp, h), y.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=gather_reduce_cost(t, k, h, itemsize=y.dtype.itemsize).to_pallas(),
        interpret=dispatch.interpret_params(resolved),
    )(r.reshape(-1), r, w, y)
    return out[:t]


# --------------------------------------------------------------------------- cost


def gather_rows_cost(m: int, h: int, *, itemsize: int = 2) -> Cost:
    """Each of M rows read once and written once, plus the indices."""
    return Cost(flops=0, bytes_accessed=2 * m * h * itemsize + 4 * m)


def gather_reduce_cost(t: int, k: int, h: int, *, itemsize: int = 2) -> Cost:
    """T*k rows read, T rows written, a multiply-add per gathered element."""
    return Cost(flops=2 * t * k * h, bytes_accessed=(t * k + t) * h * itemsize + 8 * t * k)
