"""Ceilings for bench_kernels.py: what a kernel that only streams its bytes from HBM reaches.

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
