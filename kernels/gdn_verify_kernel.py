"""Pallas TPU kernels of the GDN verify mode and its commit (the op: ``kernels/gdn_verify.py``).

Verify, grid (head block j, request r). A step reads request r's conv and recurrent state
block once from the stacked HBM states (manual DMA, as the decode kernel in
``kernels/gdn_kernels.py``; zeros for a fresh request), runs the request's n = k+1 tokens as n
decode steps in VMEM with the decode kernel's math (``gdn_kernels._decode_conv`` /
``_decode_head``) and writes o and the conv state it read. The stacked states are only read:
verify mode never writes a slot, and keeps no per-position state.

Commit, grid (head block j, request r). A step reads the slot's recurrent state block (zeros
for a fresh request) and the conv window the verify step returned, runs the first
``accepted_len[r]`` of the n positions again with the decode kernel's per-step code
(``_decode_conv``, ``gates``, ``_decode_head``; each position a static index, skipped past the
accepted length) and writes the state and conv window into the slot in place (aliased
outputs, as the decode kernel writes its slot). A request with accepted_len 0 is not touched.

Layouts: activations arrive rearranged by the wrappers, ``x [nb, R, n, cb]``,
``a, b [nb, R, n, hb]`` (head block j's channels contiguous, see ``gdn_kernels._to_blocks``);
o comes back as ``[nb, R, n, hb, Dv]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .gdn_common import F32, FRESH, VALID, conv_act, gates
from .gdn_kernels import (_NUM_SEMS, Geometry, _decode_conv, _decode_head, _decode_heads,
                          _dma_all, _head_blocks, _state_copies, _to_blocks)


def _verify_kernel(
    # Scalar prefetch
    layer_ref,  # i32[1] layer of the stacked states
    slot_ref,  # i32[R] state slot of each request
    flags_ref,  # i32[R] VALID (real request) | FRESH
    # Inputs
    alog_ref, dtb_ref,  # f32[1, hb] this head block's A_log, dt_bias
    x_ref,  # [n, cb] this request's pre-conv channels of the block
    a_ref, b_ref,  # [n, hb] gate inputs
    w_ref,  # [K, cb] conv weights of the block
    cs_hbm, rs_hbm,  # [Lyr, S, rows, C], [Lyr, S, Hv, Dk, Dv] (ANY; read only)
    # Outputs
    o_ref,  # [n, hb, Dv]
    cs0_ref,  # [rows, cb] the conv state read (zeros: fresh or padding request)
    # Scratch
    cs_buf,  # [rows, cb] conv state of the block (rows K-1.. are padding)
    s_buf,  # [hb, Dk, Dv] recurrent state block in its dtype
    sems,  # DMA semaphores
    *, geom,
):
    j, r = pl.program_id(0), pl.program_id(1)
    real = (flags_ref[r] & VALID) != 0
    fresh = (flags_ref[r] & FRESH) != 0
    n, K = x_ref.shape[0], geom.K

    @pl.when(jnp.logical_not(real))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        cs0_ref[...] = jnp.zeros(cs0_ref.shape, cs0_ref.dtype)

    @pl.when(real & fresh)
    def _():
        cs_buf[...] = jnp.zeros(cs_buf.shape, cs_buf.dtype)
        s_buf[...] = jnp.zeros(s_buf.shape, s_buf.dtype)

    @pl.when(real & jnp.logical_not(fresh))
    def _():
        _dma_all(_state_copies(geom, j, layer_ref[0], slot_ref[r], cs_hbm, rs_hbm, cs_buf,
                               s_buf), sems)

    @pl.when(real)
    def _():
        cs0_ref[...] = cs_buf[...]
        # History taps as the decode kernel reads them back: rounded through the conv dtype.
        hist = [cs_buf[i : i + 1, :].astype(F32) for i in range(K - 1)]
        hist += [x_ref[p : p + 1, :].astype(cs_buf.dtype).astype(F32) for p in range(n)]
        w = w_ref[...].astype(F32)  # [K, cb]
        g, beta = gates(a_ref[...], b_ref[...], alog_ref[...], dtb_ref[...])  # f32[n, hb]
        for p in range(n):
            taps = hist[p : p + K - 1] + [x_ref[p : p + 1, :].astype(F32)]
            y = conv_act(taps, [w[i : i + 1] for i in range(K)], w_ref.dtype, x_ref.dtype)
            qs, ks, vs = _decode_heads(y, geom)
            outs = []
            for h in range(geom.hb):
                o, s_new = _decode_head(s_buf[h].astype(F32), qs[h], ks[h], vs[h],
                                        g[p : p + 1, h : h + 1], beta[p : p + 1, h : h + 1])
                s_buf[h] = s_new.astype(s_buf.dtype)  # stored between positions as by decode
                outs.append(o)
            o_ref[p] = jnp.concatenate(outs, axis=0).astype(o_ref.dtype)


def pallas_gdn_verify(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                      state_slots, real, fresh, layer, *, geom: Geometry, cost, interpret):
    """Run the verify kernel. mixed_qkv [R*n, C], a/b [R*n, Hv]; state_slots i32[R]; real,
    fresh bool[R]; layer an i32 scalar already clipped. Returns o [R*n, Hv, Dv] (mixed_qkv's
    dtype) and the conv state each request started from, [R, rows, C] in conv_state's dtype
    (zeros: fresh or padding). The kernel
    hands that back rather than XLA gathering it: a gather would want the stacked conv state
    in another layout than the kernel's and copy all of it."""
    R = state_slots.shape[0]
    T = mixed_qkv.shape[0]
    n = T // R
    nb, hb, cb, Dk, Dv, K = geom.nb, geom.hb, geom.cb, geom.Dk, geom.Dv, geom.K
    sq = pl.Squeezed()
    flags = (real * VALID + (real & fresh) * FRESH).astype(jnp.int32)
    slots = jnp.clip(state_slots, 0, rec_state.shape[1] - 1).astype(jnp.int32)
    prefetch = (jnp.asarray(layer, jnp.int32).reshape(1), slots, flags)
    alog = _head_blocks(A_log.astype(F32), geom)[:, None, :]  # f32[nb, 1, hb]
    dtb = _head_blocks(dt_bias.astype(F32), geom)[:, None, :]
    w = jnp.moveaxis(_to_blocks(conv_weight.T, geom), 1, 0)  # [nb, K, cb]
    x_in = jnp.moveaxis(_to_blocks(mixed_qkv, geom), 1, 0).reshape(nb, R, n, cb)
    a_in, b_in = (jnp.moveaxis(_head_blocks(z, geom), 1, 0).reshape(nb, R, n, hb)
                  for z in (a, b))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    def per_block(*shape):  # block j of an [nb, *shape] array, the same at every step
        return pl.BlockSpec((sq, *shape), lambda j, i, *_: (j,) + (0,) * len(shape))

    def per_step(*shape):  # block (j, request i) of an [nb, R, *shape] array
        return pl.BlockSpec((sq, sq, *shape), lambda j, i, *_: (j, i) + (0,) * len(shape))

    rows = conv_state.shape[2]
    o, cs0 = pl.pallas_call(
        functools.partial(_verify_kernel, geom=geom),
        out_shape=(jax.ShapeDtypeStruct((nb, R, n, hb, Dv), mixed_qkv.dtype),
                   jax.ShapeDtypeStruct((nb, R, rows, cb), conv_state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(nb, R),
            in_specs=[per_block(1, hb), per_block(1, hb), per_step(n, cb), per_step(n, hb),
                      per_step(n, hb), per_block(K, cb), any_spec, any_spec],
            out_specs=[per_step(n, hb, Dv), per_step(rows, cb)],
            scratch_shapes=[pltpu.VMEM((rows, cb), conv_state.dtype),
                            pltpu.VMEM((hb, Dk, Dv), rec_state.dtype),
                            pltpu.SemaphoreType.DMA((_NUM_SEMS,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=interpret,
    )(*prefetch, alog, dtb, x_in, a_in, b_in, w, conv_state, rec_state)
    o = jnp.moveaxis(o.reshape(nb, T, hb, Dv), 1, 0).reshape(T, geom.Hv, Dv)
    return o, _from_blocks(jnp.moveaxis(cs0, 0, 2), geom)


def _commit_kernel(
    # Scalar prefetch
    layer_ref,  # i32[1] layer of the stacked states
    slot_ref,  # i32[R] state slot of each request
    acc_ref,  # i32[R] positions to re-apply, 0..n (0: the slot is not touched)
    fresh_ref,  # i32[R] 1: the request started from zeros (its slot is not read)
    # Inputs
    alog_ref, dtb_ref,  # f32[1, hb] this head block's A_log, dt_bias
    win_ref,  # [K-1+n, cb] this request's conv window from the verify step (conv dtype)
    a_ref, b_ref,  # [n, hb] gate inputs
    w_ref,  # [K, cb] conv weights of the block
    cs_hbm, rs_hbm,  # [Lyr, S, rows, C], [Lyr, S, Hv, Dk, Dv] (ANY; aliased to cs_out, rs_out)
    # Outputs
    cs_out, rs_out,
    # Scratch
    cs_buf,  # [rows, cb] conv state of the block (rows K-1.. are padding, zero)
    s_buf,  # [hb, Dk, Dv] recurrent state block in its dtype
    sems,  # DMA semaphores
    *, geom, x_dtype,
):
    j, r = pl.program_id(0), pl.program_id(1)
    acc = acc_ref[r]
    n, K = a_ref.shape[0], geom.K
    copies = functools.partial(_state_copies, geom, j, layer_ref[0], slot_ref[r])

    @pl.when(acc > 0)
    def _():
        cs_buf[...] = jnp.zeros(cs_buf.shape, cs_buf.dtype)
        cs_buf[0 : K - 1, :] = win_ref[0 : K - 1, :]

    @pl.when((acc > 0) & (fresh_ref[r] != 0))
    def _():
        s_buf[...] = jnp.zeros(s_buf.shape, s_buf.dtype)

    @pl.when((acc > 0) & (fresh_ref[r] == 0))
    def _():
        _dma_all(copies(cs_hbm, rs_hbm, cs_buf, s_buf)[-1:], sems)  # the recurrent state only

    for p in range(n):  # the decode kernel's step, position p
        @pl.when(p < acc)
        def _():
            x = win_ref[K - 1 + p : K + p, :].astype(x_dtype)  # exact: the input was this dtype
            y = _decode_conv(cs_buf, x, w_ref)  # f32[1, cb]
            qs, ks, vs = _decode_heads(y, geom)
            g, beta = gates(a_ref[p : p + 1, :], b_ref[p : p + 1, :], alog_ref[...],
                            dtb_ref[...])  # f32[1, hb]
            for h in range(geom.hb):
                _, s = _decode_head(s_buf[h].astype(F32), qs[h], ks[h], vs[h],
                                    g[:, h : h + 1], beta[:, h : h + 1])
                s_buf[h] = s.astype(s_buf.dtype)

    @pl.when(acc > 0)
    def _():
        _dma_all([(vmem, hbm) for hbm, vmem in copies(cs_out, rs_out, cs_buf, s_buf)], sems)


def pallas_gdn_commit(conv_state, rec_state, windows, a, b, conv_weight, A_log, dt_bias,
                      state_slots, accepted_len, fresh, layer, *, geom: Geometry, x_dtype,
                      cost, interpret):
    """Re-apply each request's accepted positions of one layer into its slot (in place).

    windows [R, K-1+n, C] (conv_state's dtype), a, b [R, n, Hv]; state_slots, accepted_len
    i32[R] (accepted_len 0..n, already 0 where the slot must not be written; slots clipped);
    fresh bool[R]; layer an i32 scalar already clipped; x_dtype the activations' dtype (the
    windows' input rows are cast back to it). Returns (conv_state, rec_state)."""
    R, n = a.shape[0], a.shape[1]
    nb, hb, cb, Dk, Dv, K = geom.nb, geom.hb, geom.cb, geom.Dk, geom.Dv, geom.K
    sq = pl.Squeezed()
    prefetch = (jnp.asarray(layer, jnp.int32).reshape(1), state_slots.astype(jnp.int32),
                accepted_len.astype(jnp.int32), fresh.astype(jnp.int32))
    alog = _head_blocks(A_log.astype(F32), geom)[:, None, :]  # f32[nb, 1, hb]
    dtb = _head_blocks(dt_bias.astype(F32), geom)[:, None, :]
    w = jnp.moveaxis(_to_blocks(conv_weight.T, geom), 1, 0)  # [nb, K, cb]
    win_in = jnp.moveaxis(_to_blocks(windows, geom), 2, 0)  # [nb, R, K-1+n, cb]
    a_in, b_in = (jnp.moveaxis(_head_blocks(z, geom), 2, 0) for z in (a, b))  # [nb, R, n, hb]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    def per_block(*shape):  # block j of an [nb, *shape] array, the same at every step
        return pl.BlockSpec((sq, *shape), lambda j, i, *_: (j,) + (0,) * len(shape))

    def per_step(*shape):  # block (j, request i) of an [nb, R, *shape] array
        return pl.BlockSpec((sq, sq, *shape), lambda j, i, *_: (j, i) + (0,) * len(shape))

    n_pre = len(prefetch)
    return pl.pallas_call(
        functools.partial(_commit_kernel, geom=geom, x_dtype=x_dtype),
        out_shape=(jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_pre,
            grid=(nb, R),
            in_specs=[per_block(1, hb), per_block(1, hb), per_step(K - 1 + n, cb),
                      per_step(n, hb), per_step(n, hb), per_block(K, cb), any_spec, any_spec],
            out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.VMEM((conv_state.shape[2], cb), conv_state.dtype),
                            pltpu.VMEM((hb, Dk, Dv), rec_state.dtype),
                            pltpu.SemaphoreType.DMA((_NUM_SEMS,))]),
        input_output_aliases={n_pre + 6: 0, n_pre + 7: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*prefetch, alog, dtb, win_in, a_in, b_in, w, conv_state, rec_state)


def _from_blocks(x, geom):
    """[..., nb, cb] (block j = [q_j | k_j | v_j]) -> [..., C] channels [q | k | v]."""
    lead, qk = x.shape[:-2], geom.kb * geom.Dk
    q = x[..., :qk].reshape(*lead, geom.Hk * geom.Dk)
    k = x[..., qk : 2 * qk].reshape(*lead, geom.Hk * geom.Dk)
    v = x[..., 2 * qk :].reshape(*lead, geom.Hv * geom.Dv)
    return jnp.concatenate([q, k, v], axis=-1)
