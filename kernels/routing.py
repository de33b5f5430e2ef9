"""MoE routing: sort assignments by local expert, gather token rows, weighted gather-reduce.

Dimension letters: T tokens, k top-k slots, E local experts, M = T*k sorted assignments,
H hidden, P row split (below).

Flow on one expert-parallel device:
  token_idx, group_sizes, rows = route_metadata(topk_ids, E, expert_offset=...)
  xs = gather_rows(x, token_idx)                     # [M, H], local assignments first
  ys = gmm(... xs ..., group_sizes)                  # expert outputs in sorted order
  out = gather_reduce(ys, rows, topk_weights)        # [T, H], per-token weighted sum

Both data movers are index-driven Pallas kernels: each grid step reads its block of indices
(and weights) into SMEM through a blocked SMEM input spec, so the index arrays are never held
whole in SMEM (1 MiB on TPU7x) and any T*k works; it then DMAs every needed row from HBM
(``pl.ANY``) into a VMEM buffer, with up to ``NUM_INFLIGHT`` row copies outstanding. No
one-hot or padded permutation matrix exists.

TPU layout. Mosaic tiles only the last two dims of a buffer ((8, 128) 32-bit, (16, 128) bf16,
(32, 128) 8-bit in registers; XLA stores [M, H] bf16 in HBM as (8, 128) tiles of row pairs)
and rejects dynamic offsets along tiled dims unless provably tile-aligned, so one row can
never be sliced out of an [M, H] array. The wrappers therefore view the source as
``[rows, P, H/P]``: a row is ``src.at[idx]``, an index into the leading, untiled dim, and is
DMA'd whole-tile into a VMEM buffer ``[n, P, H/P]`` at leading index ``i``. ``P``
(:func:`row_split`) is the largest power of two <= the dtype's tile rows (8 f32, 16 bf16,
32 8-bit) with H % (128 P) == 0, so a row fills whole tiles and the buffer carries no padding
(H = 4096: P = 16 bf16, a row is one [16, 256] slab; P = 8 f32). Smaller H pads: H = 128
has P = 1 and a bf16 row pads to 2 sublanes (f32 none); an H that is not a multiple of 128
pads each row's lanes to the next multiple of 128. Each kernel reshapes its gathered block
to dense [rows, H] in registers before the output store, so the outputs are ordinary
[M, H] / [T, H] arrays in XLA's default layout.

Cost of the view: it is not a bitcast of XLA's [rows, H] layout, so XLA relayouts the source
once in HBM before the kernel (one read + write of it): x [T, H] for gather_rows (1/k of the
kernel's traffic), y [M, H] for gather_reduce (about doubles that kernel's HBM traffic, and
an M x H temporary) unless y arrives as [M, P, H/P]: the MoE's down projection writes it that
way (``gmm(..., row_split=P)``), so the model's step has no such copy.

VMEM (default blocks, H = 4096 bf16, k = 10): gather_rows 3 MiB = a [128, 16, 256] row
buffer (1 MiB) + the double-buffered [128, 4096] output block (2 MiB); gather_reduce 3.5 MiB
= a [320, 16, 256] row buffer (2.5 MiB) + f32[32, 16, 256] sums (0.5 MiB) + double-buffered
[32, 4096] output blocks (0.5 MiB). On TPU the SMEM index blocks constrain the block sizes:
``gather_rows`` a power of two >= 128 unless one block covers all rows, ``reduce_tokens`` a
multiple of 8.
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

NUM_INFLIGHT = 8  # row DMAs kept in flight per kernel step


@dataclasses.dataclass(frozen=True)
class RoutingBlockSizes:
    """Rows per grid step: gather output rows, and tokens per gather-reduce step."""

    gather_rows: int = 128
    reduce_tokens: int = 32


def _check_smem_block(name: str, block: int, padded: int, legal: bool, rule: str) -> None:
    """Raise a ValueError naming ``RoutingBlockSizes.<name>`` when a block of ``block`` rows
    over ``padded`` rows (several grid steps) breaks Mosaic's SMEM block rule ``rule``: one
    block over the whole array is always legal."""
    if block != padded and not legal:
        raise ValueError(f"RoutingBlockSizes.{name}={block} is not a legal TPU block over "
                         f"{padded} rows: {rule} (or one block covering every row)")


def _gather_rows_legal(rows: int) -> bool:  # Mosaic's rank-1 SMEM block rule
    return (rows >= 128 and rows & (rows - 1) == 0) or (rows > 0 and rows % 1024 == 0)


def _reduce_tokens_legal(tokens: int) -> bool:  # rows of an SMEM [tokens, k] block
    return tokens > 0 and tokens % 8 == 0


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _blocks(block_sizes: RoutingBlockSizes | None) -> RoutingBlockSizes:
    """The caller's block sizes, else the defaults with this TPU generation's table overrides
    (block_tables.py) where legal for any row count (the SMEM rules of ``_check_smem_block``)."""
    def legal(b: RoutingBlockSizes) -> bool:
        return _gather_rows_legal(b.gather_rows) and _reduce_tokens_legal(b.reduce_tokens)

    return block_sizes or block_tables.pick("routing", RoutingBlockSizes(), legal)


def row_split(h: int, dtype) -> int:
    """P for the [rows, P, H/P] view: the largest power of two <= the dtype's tile rows
    (8 f32, 16 bf16, 32 for 8-bit) dividing H into multiples of 128 lanes; 1 if none does."""
    p = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    while p > 1 and h % (p * 128):
        p //= 2
    return p


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


def _copy_rows(src_hbm, index_of, buf, num, sem):
    """``buf[i] = src_hbm[index_of(i)]`` for i < num, NUM_INFLIGHT row DMAs in flight.

    src_hbm [R, P, H/P] and buf [n, P, H/P]: both row indices are leading (untiled) dims, so
    every DMA is whole tiles. Rows whose index is negative are zero-filled instead. Slot
    ``i % NUM_INFLIGHT`` of ``sem`` tracks copy i.
    """

    def copy(i, idx):
        return pltpu.make_async_copy(src_hbm.at[idx], buf.at[i], sem.at[i % NUM_INFLIGHT])

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

        @pl.when(idx < 0)
        def _():
            buf[i] = jnp.zeros(buf.shape[1:], buf.dtype)  # [P, H/P]

        return carry

    jax.lax.fori_loop(0, num, body, 0)

    def drain(i, carry):
        @pl.when(index_of(i) >= 0)
        def _():
            copy(i, 0).wait()

        return carry

    jax.lax.fori_loop(max(num - NUM_INFLIGHT, 0), num, drain, 0)


def _gather_rows_kernel(
    num_ref,  # Prefetch (SMEM): i32[1] rows to write; blocks past it are skipped
    idx_ref,  # Input (SMEM): i32[bm] source row per output row of this block, -1 = zeros
    x_hbm,  # Input: [T, P, H/P] in HBM (pl.ANY)
    o_ref,  # Output: [bm, H]
    buf,  # Scratch: [bm, P, H/P] gathered rows
    sem,  # Scratch: DMA semaphores[NUM_INFLIGHT]
    *, bm,
):
    @pl.when(pl.program_id(0) * bm < num_ref[0])
    def _():  # a skipped block's grid step maps to the last live block and leaves it as is
        _copy_rows(x_hbm, lambda i: idx_ref[i], buf, bm, sem)
        o_ref[...] = buf[...].reshape(o_ref.shape)  # [bm, P, H/P] -> [bm, H]


def _gather_reduce_kernel(
    rows_ref,  # Input (SMEM): i32[bt, k] sorted row of each (token, slot), -1 = skipped
    w_ref,  # Input (SMEM): f32[bt, k] routing weights
    y_hbm,  # Input: [M, P, H/P] in HBM (pl.ANY)
    o_ref,  # Output: [bt, H]
    buf,  # Scratch: [bt * k, P, H/P] gathered expert rows, token-major
    acc_ref,  # Scratch: f32[bt, P, H/P] per-token sums
    sem,  # Scratch: DMA semaphores[NUM_INFLIGHT]
    *, bt, k,
):
    # buf[t * k + j] = y[rows[t, j]]; skipped slots are zero rows
    _copy_rows(y_hbm, lambda i: rows_ref[i // k, i % k], buf, bt * k, sem)

    def token(t, carry):
        acc = jnp.zeros(acc_ref.shape[1:], jnp.float32)  # f32[P, H/P]
        for j in range(k):
            w = jnp.where(rows_ref[t, j] >= 0, w_ref[t, j], 0.0)  # f32; skipped slots weigh 0
            acc += w * buf[t * k + j].astype(jnp.float32)  # f32[P, H/P]
        acc_ref[t] = acc
        return carry

    jax.lax.fori_loop(0, bt, token, 0)
    o_ref[...] = acc_ref[...].reshape(o_ref.shape).astype(o_ref.dtype)  # [bt, P, H/P] -> [bt, H]


# --------------------------------------------------------------------------- public API


def gather_rows(x, token_idx, *, num_rows=None, cost_rows: int | None = None, impl=None,
                block_sizes: RoutingBlockSizes | None = None):
    """Gather token rows into sorted-assignment order.

    Args:
      x: [T, H] token hidden states.
      token_idx: i32[M] source row per output row; entries < 0 (or >= T) give zero rows.
      num_rows: optional i32 scalar (may be traced): the Pallas kernel writes only the row
        blocks that start below it; later rows are unspecified and cost no traffic
        (``route_metadata`` puts the local rows first, so their count is enough).
      cost_rows: rows the Pallas ``CostEstimate`` charges (static; default M).
      impl: see ``kernels/dispatch.py`` (static under jit).
    Returns:
      [M, H] in x.dtype.
    """
    _validate_gather(x, token_idx)
    resolved = dispatch.resolve(impl)
    if resolved == "reference" or token_idx.shape[0] == 0:
        return ref_gather_rows(x, token_idx)
    m, (t, h) = token_idx.shape[0], x.shape
    p = row_split(h, x.dtype)
    bm = min(_blocks(block_sizes).gather_rows, _round_up(m, 16))
    mp = _round_up(m, bm)
    _check_smem_block("gather_rows", bm, mp, _gather_rows_legal(bm),
                      "a rank-1 SMEM block must be a power of two >= 128 or a multiple of 1,024")
    idx = token_idx.astype(jnp.int32)
    idx = jnp.where(idx < t, idx, -1)  # out-of-range rows read nothing (zeros)
    idx = jnp.pad(idx, (0, mp - m), constant_values=-1)  # i32[Mp]
    num = jnp.full((1,), mp if num_rows is None else num_rows, jnp.int32)
    x3 = x.reshape(t, p, h // p)  # [T, P, H/P]: a row is x3[idx], a leading index

    def block(i, num_ref):  # skipped blocks revisit the last live one: no DMA, no write-back
        return jnp.minimum(i, jnp.maximum(num_ref[0] + bm - 1, bm) // bm - 1)

    out = pl.pallas_call(
        functools.partial(_gather_rows_kernel, bm=bm),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(mp // bm,),
            in_specs=[
                pl.BlockSpec((bm,), lambda i, n: (block(i, n),), memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((bm, h), lambda i, n: (block(i, n), 0)),
            scratch_shapes=[
                pltpu.VMEM((bm, p, h // p), x.dtype),  # gathered rows of this block
                pltpu.SemaphoreType.DMA((NUM_INFLIGHT,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, h), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=gather_rows_cost(m if cost_rows is None else cost_rows, h,
                                       itemsize=x.dtype.itemsize).to_pallas(),
        interpret=dispatch.interpret_params(resolved),
    )(num, idx, x3)
    return out[:m]


def gather_reduce(y, rows, weights, *, cost_reads: int | None = None, impl=None,
                  block_sizes: RoutingBlockSizes | None = None):
    """Weighted un-permute: ``out[t] = sum_j weights[t, j] * y[rows[t, j]]`` over rows >= 0.

    Args:
      y: [M, H] expert outputs in sorted-assignment order, or the same already viewed as
        [M, P, H/P] with ``P = row_split(H, y.dtype)`` (``gmm(..., row_split=P)`` writes it
        so: then no relayout copy of y precedes the kernel on TPU).
      rows: i32[T, k] from :func:`route_metadata` (-1 = not local, skipped; >= M skipped too).
      weights: f32[T, k] routing weights.
      cost_reads: rows of y the Pallas ``CostEstimate`` charges (static; default T*k): the
        kernel DMAs only the slots with a valid row, e.g. ~T*k/D on an expert-parallel device.
      impl: see ``kernels/dispatch.py`` (static under jit).
    Returns:
      [T, H] in y.dtype, summed in fp32.
    """
    if y.ndim == 3:  # the [M, P, H/P] view
        m, p, hp = y.shape
        if p != row_split(p * hp, y.dtype):
            raise ValueError(f"y viewed as {y.shape} must have P = row_split(H) = "
                             f"{row_split(p * hp, y.dtype)}")
        y3, y = y, y.reshape(m, p * hp)  # the reshape is free off-TPU and unused on it
    else:
        y3 = None
    _validate_reduce(y, rows, weights)
    resolved = dispatch.resolve(impl)
    t, k = rows.shape
    if resolved == "reference" or t == 0 or k == 0:
        return ref_gather_reduce(y, rows, weights)
    m, h = y.shape
    p = row_split(h, y.dtype)
    bt = min(_blocks(block_sizes).reduce_tokens, _round_up(t, 8))
    tp = _round_up(t, bt)
    _check_smem_block("reduce_tokens", bt, tp, _reduce_tokens_legal(bt),
                      "the rows of an SMEM [tokens, k] block must be a multiple of 8")
    r = rows.astype(jnp.int32)
    r = jnp.pad(jnp.where(r < m, r, -1), ((0, tp - t), (0, 0)), constant_values=-1)  # i32[Tp, k]
    w = jnp.pad(weights.astype(jnp.float32), ((0, tp - t), (0, 0)))  # f32[Tp, k]
    if y3 is None:  # [M, P, H/P]: a row is y3[row], a leading index
        y3 = y.reshape(m, p, h // p)
    smem_block = pl.BlockSpec((bt, k), lambda i: (i, 0), memory_space=pltpu.SMEM)
    out = pl.pallas_call(
        functools.partial(_gather_reduce_kernel, bt=bt, k=k),
        grid=(tp // bt,),
        in_specs=[smem_block, smem_block, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((bt, h), lambda i: (i, 0)),
        scratch_shapes=[
            pltpu.VMEM((bt * k, p, h // p), y.dtype),  # gathered rows of this token block
            pltpu.VMEM((bt, p, h // p), jnp.float32),  # per-token fp32 sums
            pltpu.SemaphoreType.DMA((NUM_INFLIGHT,)),
        ],
        out_shape=jax.ShapeDtypeStruct((tp, h), y.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=gather_reduce_cost(t, k, h, itemsize=y.dtype.itemsize,
                                         reads=cost_reads).to_pallas(),
        interpret=dispatch.interpret_params(resolved),
    )(r, w, y3)
    return out[:t]


# --------------------------------------------------------------------------- cost


def gather_rows_cost(m: int, h: int, *, itemsize: int = 2) -> Cost:
    """Each of M rows read once and written once, plus the indices."""
    return Cost(flops=0, bytes_accessed=2 * m * h * itemsize + 4 * m)


def gather_reduce_cost(t: int, k: int, h: int, *, itemsize: int = 2,
                       reads: int | None = None) -> Cost:
    """``reads`` rows read (default T*k), T rows written, a multiply-add per gathered element."""
    reads = t * k if reads is None else reads
    return Cost(flops=2 * reads * h, bytes_accessed=(reads + t) * h * itemsize + 8 * t * k)
