"""Ceilings for bench_kernels.py: what a kernel that only streams its bytes from HBM reaches,
and what a kernel's matmuls alone reach.

A weight-streaming kernel (decode MoE, decode attention, GDN decode) cannot beat a Pallas
kernel that reads the same bytes in blocks of the same size and does nothing else. Its time
on the chip, beside XLA's own reduction of the array, is the measured ceiling the issue asks
for where a kernel misses its fraction of the HBM roofline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_backend.kernels import gdn_geometry
from sglang_tpu_backend.kernels import gdn_kernels as gk


def _stream_kernel(x_ref, o_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += x_ref[0, :8, :].astype(jnp.float32)  # touches one row group per block


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def stream_read(x, *, block_rows: int, interpret: bool = False):
    """Read all of x [G, R, C] in [1, block_rows, C] blocks (double-buffered DMAs, as every
    BlockSpec pipeline); returns f32[8, C], a sum of each block's first 8 rows (so the reads
    are used). HBM traffic: x.nbytes."""
    g, r, c = x.shape
    big = block_rows * c * x.dtype.itemsize
    return pl.pallas_call(
        _stream_kernel,
        grid=(g, r // block_rows),
        in_specs=[pl.BlockSpec((1, block_rows, c), lambda i, j: (i, j, 0))],
        out_specs=pl.BlockSpec((8, c), lambda i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, c), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=max(16 << 20, 3 * big)),
        interpret=interpret,
    )(x)


def _dma_read_kernel(x_hbm, o_ref, buf, sems, *, in_flight: int):
    n = x_hbm.shape[0]

    def copy(chunk, slot):
        return pltpu.make_async_copy(x_hbm.at[chunk], buf.at[slot], sems.at[slot])

    for c in range(min(in_flight, n)):
        copy(c, c).start()

    def body(c, acc):
        slot = c % in_flight
        copy(c, slot).wait()
        acc = acc + buf[slot, :8, :].astype(jnp.float32)

        @pl.when(c + in_flight < n)
        def _():
            copy(c + in_flight, slot).start()
        return acc

    o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("chunk_rows", "in_flight", "interpret"))
def dma_read(x, *, chunk_rows: int, in_flight: int, interpret: bool = False):
    """Read all of x [G, R, C] as [chunk_rows, C] chunks with ``in_flight`` DMAs outstanding
    (a ring of that many VMEM buffers, each refilled as soon as it is used); returns f32[8, C],
    a sum of each chunk's first 8 rows. HBM traffic: x.nbytes. Against ``stream_read`` (one
    DMA per operand in flight, as a BlockSpec pipeline keeps): how many concurrent DMAs the
    chip's HBM read bandwidth needs."""
    g, r, c = x.shape
    chunks = x.reshape(g * r // chunk_rows, chunk_rows, c)
    buf_bytes = in_flight * chunk_rows * c * x.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_dma_read_kernel, in_flight=in_flight),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        out_shape=jax.ShapeDtypeStruct((8, c), jnp.float32),
        scratch_shapes=[pltpu.VMEM((in_flight, chunk_rows, c), x.dtype),
                        pltpu.SemaphoreType.DMA((in_flight,))],
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=max(16 << 20, buf_bytes + (4 << 20))),
        interpret=interpret,
    )(chunks)


def xla_sum(x):
    """XLA's reduction of x to f32[C]: one read of x at the compiler's best."""
    return jnp.sum(x.astype(jnp.float32), axis=(0, 1))


# ---------------------------------------------------------------------------- MXU ceilings
# A kernel that misses its share of the MXU (attention prefill) or runs far from its roofline
# on a chain of small matmuls (GDN chunked prefill) is held against its matmuls alone: the same
# products at the same shapes and dtypes, over the same grid and BlockSpec pipeline, with none
# of the element-wise work around them (softmax, masks, conv, gates, decays) and no XLA wrapper.


def _attention_matmuls_kernel(nblk_ref, q_ref, k_ref, v_ref, o_ref, *, bkv: int):
    """One (item, kv head, q block) step: the sum over its causal kv blocks of
    bf16(q @ k^T) @ v, accumulated in f32; no max, exp, row sum or mask."""
    q = q_ref[...]  # [G*bq, D]

    def body(b, acc):
        start = pl.multiple_of(b * bkv, bkv)
        k, v = k_ref[pl.ds(start, bkv), :], v_ref[pl.ds(start, bkv), :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return acc + jnp.dot(s.astype(v.dtype), v, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, nblk_ref[pl.program_id(2)], body,
                            jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group", "q_tokens", "kv_block", "interpret"))
def attention_matmuls(q, k, v, *, group: int, q_tokens: int, kv_block: int,
                      interpret: bool = False):
    """The MXU work of causal prefill attention, nothing else.

    q [R, Hkv, T*G, D]: item r's T new tokens, the G query heads of each kv head row-major
    within a token (``group`` = G); k, v [R, Hkv, Ctx, D]: the item's whole context, whose
    last T positions are the new tokens. Grid (item, kv head, q block of ``q_tokens`` tokens
    = G * q_tokens rows); a step multiplies its q block by every ``kv_block``-key block up to
    the block's causal bound (its last token's position + 1, rounded up to a block), as a
    flash kernel visits them, with the item's K and V of the kv head resident in VMEM (no
    page DMAs: an upper bound for a paged kernel). Returns o [R, Hkv, T*G, D] in q.dtype,
    the products' sum (kept so that nothing is dead code).
    """
    r, hkv, rows, d = q.shape
    ctx = k.shape[2]
    t_new, bq = rows // group, q_tokens * group
    nq = t_new // q_tokens
    ends = ctx - t_new + q_tokens * jnp.arange(1, nq + 1, dtype=jnp.int32)  # keys seen
    nblk = -(-ends // kv_block)
    sq = pl.Squeezed()
    kv_spec = pl.BlockSpec((sq, sq, ctx, d), lambda i, h, j, *_: (i, h, 0, 0))
    q_spec = pl.BlockSpec((sq, sq, bq, d), lambda i, h, j, *_: (i, h, j, 0))
    return pl.pallas_call(
        functools.partial(_attention_matmuls_kernel, bkv=kv_block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(r, hkv, nq),
            in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(nblk, q, k, v)


def xla_attention_matmuls(q, k, v):
    """XLA's matmuls of the same shapes as :func:`attention_matmuls`, over every key of the
    context for every query (dense: no causal skip), bf16 scores, f32 accumulation."""
    s = jnp.einsum("rhqd,rhkd->rhqk", q, k, preferred_element_type=jnp.float32)
    return jnp.einsum("rhqk,rhkd->rhqd", s.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def _gdn_matmuls_kernel(q_ref, k_ref, v_ref, beta_ref, o_ref, s_scr, *, rep: int, mm):
    """One (head block, chunk) step of the chunked delta rule's matmuls (those of
    ``gdn_kernels._chunk_delta_rule``, in its operand dtypes): K K^T and Q K^T per qk head,
    the unit-lower inverse by doubling (three bf16 passes a product with bf16 operands, as
    the kernel's) of each value head's tril(beta K K^T), U and W, the state's three products
    and its update. The state carries across the steps of a head block. Without beta the
    value heads of a qk head would invert the same matrix, and Mosaic computes a repeated
    value once: the inverse would cost a quarter of the kernel's at 4 value heads a qk head."""
    @pl.when(pl.program_id(1) == 0)
    def _():
        s_scr[...] = jnp.zeros(s_scr.shape, jnp.float32)

    q, k = q_ref[...], k_ref[...]  # [kb, L, Dk]
    v = v_ref[...].astype(jnp.float32)  # [hb, L, Dv]
    L = q.shape[1]
    kk = gk._per_value_head(gk._bdot_nt(k, k, mm), rep)  # f32[hb, L, L]
    qk = gk._per_value_head(gk._bdot_nt(q, k, mm), rep)
    qh, kh = (gk._per_value_head(x.astype(jnp.float32), rep) for x in (q, k))
    row = jax.lax.broadcasted_iota(jnp.int32, (1, L, L), 1)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, L, L), 2)
    bcol = gk._per_head(beta_ref[...].astype(jnp.float32), kk.shape[0])  # f32[hb, L, 1]
    t_inv = gk.unit_lower_inverse(jnp.where(row > col, bcol * kk, 0.0),
                                  three_pass=mm != jnp.float32)
    s = s_scr[...]
    u, w = gk._bdot(t_inv, v, mm), gk._bdot(t_inv, kh, mm)
    v_new = u - gk._bdot(w, s, mm)
    o = gk._bdot(qh, s, mm) + gk._bdot(jnp.where(row >= col, qk, 0.0), v_new, mm)
    s_scr[...] = s + gk._bdot_tn(kh, v_new, mm)
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rep", "interpret"))
def gdn_chunk_matmuls(q, k, v, beta, *, rep: int, interpret: bool = False):
    """The chunked GDN kernel's matmul chain alone.

    q, k [nb, N, kb, L, Dk], v [nb, N, kb*rep, L, Dv] (head block j's chunk i, as the chunk
    kernel's grid visits them; bf16 operands give its bf16 matmuls, f32 its HIGHEST ones),
    beta [nb, N, L, kb*rep] (each value head's write strength, as the kernel's gate input).
    Grid (head block, chunk), the f32 state [hb, Dk, Dv] in VMEM scratch across a block's
    chunks. Returns o [nb, N, hb, L, Dv] in v.dtype.
    """
    nb, n, kb, L, dk = q.shape
    hb, dv = v.shape[2], v.shape[4]
    mm = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    sq = pl.Squeezed()

    def step(*shape):
        return pl.BlockSpec((sq, sq, *shape), lambda j, i: (j, i, 0, 0, 0))

    return pl.pallas_call(
        functools.partial(_gdn_matmuls_kernel, rep=rep, mm=mm),
        grid=(nb, n),
        in_specs=[step(kb, L, dk), step(kb, L, dk), step(hb, L, dv),
                  pl.BlockSpec((sq, sq, L, hb), lambda j, i: (j, i, 0, 0))],
        out_specs=step(hb, L, dv),
        out_shape=jax.ShapeDtypeStruct((nb, n, hb, L, dv), v.dtype),
        scratch_shapes=[pltpu.VMEM((hb, dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=gdn_geometry.chunk_vmem_limit(gdn_geometry.Geometry(
                Hk=nb * kb, Hv=nb * hb, Dk=dk, Dv=dv, K=4, kb=kb, L=L))),
        interpret=interpret,
    )(q, k, v, beta)
