"""Pallas TPU kernels of the fused causal conv1d + Gated DeltaNet (the op: ``kernels/gdn.py``).

Two kernels over a grid (head block j, step i): ``_decode_kernel`` (step = rb consecutive
decode rows, one token per request) and ``_chunk_kernel`` (step = chunk of one request; a
request's chunks are consecutive steps of the same head block and carry its state in VMEM
scratch).

The decode kernel handles rb = ``geom.rb`` rows per grid step (``GdnBlockSizes.rows_per_step``;
the wrapper pads the rows to a multiple of rb), so rb rows share a step's fixed cost (its
BlockSpec DMAs of x, a, b and o, the step itself), and software-pipelines its state DMAs
across steps (``kernels/gdn_decode_pipeline.py``): the state scratch is double buffered by
step (``[2, rb, ...]``), the rb fetches of step i+1 are started while step i computes, and each
row's write-back is left in flight until its buffer slot is refilled one step later (or the
last step ends). FRESH rows skip the fetch (zero state in their buffer slot), padding rows
move nothing. Real rows of a batch own distinct state slots, which is what makes the overlap
safe (see that module).

Layouts, and why Mosaic accepts them (it tiles only the last two dims of a buffer, (8, 128)
for 32-bit and (16, 128) for bf16, and needs dynamic offsets there to be provably aligned):
  * Every dynamic index -- layer, state slot, head block, decode row, chunk -- addresses a
    leading, untiled dimension. No kernel slices a tiled dimension at a dynamic offset.
  * Per-step activations are rearranged by the wrapper (XLA), not in the kernel: the ragged
    tokens are gathered into chunks ``[N, L, C]`` (one row gather; rows past a chunk's length
    hold other tokens, which the kernel masks), decode rows into ``[nb, T', 1, cb]`` (T' = T
    rounded up to a multiple of rb; a block of rb rows is legal as the row dim is leading),
    gate inputs into ``[nb, N, L, hb]`` / ``[nb, T', 1, hb]``. A chunk step reads head block
    j's channels ``[q_j | k_j | v_j]`` straight from the chunk rows with three BlockSpecs
    when their widths are multiples of 128 (``_column_blocks``), else from a copy
    ``[nb, N, L, cb]`` with them contiguous (decode steps read ``[nb, T', 1, cb]``). BlockSpecs
    then pipeline automatically. The output comes back as
    ``[N, L, Hv*Dv]`` (chunk rows, heads on lanes) / ``[nb, T', hb, Dv]`` and is un-chunked by
    the wrapper with one row gather.
  * Persistent states keep their one layout, ``conv_state [Lyr, S, rows, C]`` (channels on
    lanes; rows = K-1 rounded up to a power of two, see ``gdn_common.conv_state_rows``, so
    XLA's default layout of the array is the row-major one Mosaic takes) and
    ``rec_state [Lyr, S, Hv, Dk, Dv]``, and are moved by manual DMA from the
    aliased HBM arrays: ``cs.at[layer, slot, :, pl.ds(c0, w)]`` (all rows; lane
    offset c0 and width w multiples of 128, or the whole C when there is one head block)
    and ``rs.at[layer, slot, pl.ds(j * hb, hb)]`` (Dk, Dv whole). Only the touched slots of
    the touched layer are written; everything else stays bit-identical.
  * Inside the kernels only static slices touch tiled dims (conv taps at static row offsets,
    per-head lane slices); the last K-1 inputs of a chunk of dynamic length, and the blocks of
    the unit-lower inverse, are picked with iota masks instead of dynamic sublane indexing.

The chunk kernel works on all heads of its block at once: per-head operands are stacked on a
new leading (untiled) dim, ``[hb, L, D]`` / ``[hb, L, L]``, and multiplied with matmuls batched
over it (``_bdot*``), so a fatter head block adds work per grid step, not unrolled code. The
chunk's (I + n)^-1 is formed by log-depth block doubling (:func:`unit_lower_inverse`), not by
L-1 sequential row substitutions.

Dimension letters as in ``kernels/gdn.py``; nb head blocks of kb qk heads and hb = kb * Hv / Hk
value heads; cb = 2 * kb * Dk + hb * Dv block channels; P = K-1 rounded up to 8; rb decode rows
per grid step. The geometry, block sizes and VMEM estimates live in ``kernels/gdn_geometry.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .gdn_common import (F32, FIRST, FRESH, HI, LAST, VALID, chunk_layout, conv_act,
                         decode_rows, gates, l2norm, num_chunk_slots, token_meta)
from .gdn_decode_pipeline import WRITE_BACK, pipelined_steps
from .gdn_geometry import (Geometry, block_error, chunk_vmem_limit,  # noqa: F401 (re-exported)
                           decode_vmem_limit, default_k_heads_per_block)

_NUM_SEMS = 4  # DMA semaphores: conv segments (<= 3) + recurrent state block


# ----------------------------------------------------------------------------- kernel helpers


def _dma_all(pairs, sems):
    """Start every (src, dst) copy, then wait for all of them (their latencies overlap)."""
    copies = [pltpu.make_async_copy(s, d, sems.at[i]) for i, (s, d) in enumerate(pairs)]
    for cp in copies:
        cp.start()
    for cp in copies:
        cp.wait()


def _state_copies(geom, j, layer, slot, cs_hbm, rs_hbm, cs_buf, s_buf):
    """(HBM, VMEM) ref pairs of head block j's conv and recurrent state in (layer, slot)."""
    pairs = [(cs_hbm.at[layer, slot, :, pl.ds(c0, w)], cs_buf.at[:, pl.ds(b0, w)])
             for c0, b0, w in geom.conv_segments(j)]  # [rows, w] each
    pairs.append((rs_hbm.at[layer, slot, pl.ds(j * geom.hb, geom.hb)], s_buf))  # [hb, Dk, Dv]
    return pairs


def _dot(x, y):  # [m, k] @ [k, n]
    return jnp.dot(x, y, precision=HI, preferred_element_type=F32)


def _block_heads(y, geom):
    """Post-conv block channels f32[L, cb] -> per value head of the block: q, k f32[L, Dk]
    (l2-normed, q scaled by Dk^-0.5; shared by the rep value heads of a qk head), v f32[L, Dv]."""
    kb, Dk, Dv, rep = geom.kb, geom.Dk, geom.Dv, geom.rep
    qk = kb * Dk
    q = [l2norm(y[:, i * Dk : (i + 1) * Dk]) * (Dk**-0.5) for i in range(kb)]
    k = [l2norm(y[:, qk + i * Dk : qk + (i + 1) * Dk]) for i in range(kb)]
    v = [y[:, 2 * qk + h * Dv : 2 * qk + (h + 1) * Dv] for h in range(geom.hb)]
    return [q[h // rep] for h in range(geom.hb)], [k[h // rep] for h in range(geom.hb)], v


# ----------------------------------------------------------------------------- decode kernel


def _decode_conv(cs_buf, x, w_ref):
    """One conv step: window = [conv state rows (oldest first) | x], x [1, cb] in the
    activations' dtype. Returns y f32[1, cb] and shifts the window into rows 0..K-2 of
    cs_buf [rows, cb] (padding rows stay zero)."""
    K = w_ref.shape[0]
    taps = [cs_buf[i : i + 1, :].astype(F32) for i in range(K - 1)] + [x.astype(F32)]
    w = w_ref[...].astype(F32)  # [K, cb]
    y = conv_act(taps, [w[i : i + 1] for i in range(K)], w_ref.dtype, x.dtype)
    cs_buf[0 : K - 1, :] = jnp.concatenate(taps[1:], axis=0).astype(cs_buf.dtype)
    return y


def _column(x):
    """f32[1, D] -> f32[D, 1] without a relayout: the diagonal of x broadcast down the rows,
    summed across the lanes (VPU select + XLU lane reduce)."""
    D = x.shape[-1]
    rows, cols = (lax.broadcasted_iota(jnp.int32, (D, D), d) for d in (0, 1))
    return jnp.sum(jnp.where(rows == cols, x, 0.0), axis=1, keepdims=True)


def _decode_heads(y, geom):
    """``_block_heads`` of one decode row y f32[1, cb], with q and k as columns f32[Dk, 1]
    (``_column``, once per qk head, shared by its rep value heads); v stays f32[1, Dv]."""
    q, k, v = _block_heads(y, geom)  # q[h], k[h] are the same array for a qk head's heads
    first = range(0, geom.hb, geom.rep)  # the first value head of each qk head
    q_cols, k_cols = [_column(q[h]) for h in first], [_column(k[h]) for h in first]
    return ([q_cols[h // geom.rep] for h in range(geom.hb)],
            [k_cols[h // geom.rep] for h in range(geom.hb)], v)


def _decode_head(s, q_col, k_col, v, g, beta):
    """Rearranged delta-rule step of one head (as ``gdn._decode_step``), on the VPU.

    s f32[Dk, Dv]; q_col, k_col f32[Dk, 1] (``_decode_heads``); v f32[1, Dv];
    g, beta f32[1, 1]. Returns o f32[1, Dv] and the new state: o = q.S_pre + (q.k) d and
    S_pre + k^T d, with S_pre = exp(g) S and d = beta (v - k.S_pre).

    The vector-matrix products are broadcast multiplies reduced over the sublanes, not MXU
    matmuls: with one row (M = 1) an f32 matmul at HIGHEST precision spends six MXU passes on
    pushing S in for a single output row, and the VPU does the same sums exactly in f32.
    """
    s = s * jnp.exp(g)
    d = beta * (v - jnp.sum(k_col * s, axis=0, keepdims=True))  # [1, Dv]
    qk = jnp.sum(q_col * k_col, axis=0, keepdims=True)  # [1, 1]
    o = jnp.sum(q_col * s, axis=0, keepdims=True) + qk * d
    return o, s + k_col * d


def _decode_kernel(
    # Scalar prefetch
    layer_ref,  # i32[1] layer of the stacked states
    slot_ref,  # i32[T'] state slot of each row (T' = steps * rb, padded)
    flags_ref,  # i32[T'] VALID (real row) | FRESH; 0 on padding rows
    # Inputs
    alog_ref, dtb_ref,  # f32[1, hb] this head block's A_log, dt_bias
    x_ref,  # [rb, 1, cb] this step's rows' pre-conv channels of the block
    a_ref, b_ref,  # [rb, 1, hb] this step's rows' gate inputs
    w_ref,  # [K, cb] conv weights of the block
    cs_hbm, rs_hbm,  # [Lyr, S, rows, C], [Lyr, S, Hv, Dk, Dv] (ANY; aliased to cs_out, rs_out)
    # Outputs
    o_ref,  # [rb, hb, Dv]
    cs_out, rs_out,
    # Scratch, double buffered: buffer i % 2 holds step i's rb rows (gdn_decode_pipeline)
    cs_buf,  # [2, rb, rows, cb] conv states of the block (in and out; rows K-1.. are padding)
    s_buf,  # [2, rb, hb, Dk, Dv] recurrent state blocks in their dtype (in and out)
    sems,  # DMA semaphores [2 (FETCH, WRITE_BACK), 2 buffers, rb, _NUM_SEMS]
    *, geom,
):
    j = pl.program_id(0)

    def transfer(row, buf, r, direction):  # the same descriptors for a copy's start and wait
        out = direction == WRITE_BACK
        pairs = _state_copies(geom, j, layer_ref[0], slot_ref[row], cs_out if out else cs_hbm,
                              rs_out if out else rs_hbm, cs_buf.at[buf, r], s_buf.at[buf, r])
        return [pltpu.make_async_copy(*(pair[::-1] if out else pair),
                                      sems.at[direction, buf, r, i])
                for i, pair in enumerate(pairs)]

    def padding(r):
        o_ref[r] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)

    def zero_state(buf, r):
        cs_buf[buf, r] = jnp.zeros(cs_buf.shape[2:], cs_buf.dtype)
        s_buf[buf, r] = jnp.zeros(s_buf.shape[2:], s_buf.dtype)

    def compute(buf, r):
        cs, st = cs_buf.at[buf, r], s_buf.at[buf, r]
        y = _decode_conv(cs, x_ref[r], w_ref)  # f32[1, cb]
        qs, ks, vs = _decode_heads(y, geom)
        g, beta = gates(a_ref[r], b_ref[r], alog_ref[...], dtb_ref[...])  # f32[1, hb]
        outs = []
        for h in range(geom.hb):
            o, s = _decode_head(st[h].astype(F32), qs[h], ks[h], vs[h], g[:, h : h + 1],
                                beta[:, h : h + 1])
            st[h] = s.astype(st.dtype)
            outs.append(o)
        o_ref[r] = jnp.concatenate(outs, axis=0).astype(o_ref.dtype)

    pipelined_steps(flags_ref, geom.rb, transfer, zero_state=zero_state, compute=compute,
                    padding=padding)


# ----------------------------------------------------------------------------- chunk kernel


def _chunk_conv(ext, x_refs, w_ref, length, geom):
    """Causal conv + SiLU of one chunk.

    ext f32[P+L, cb]: rows P-(K-1)..P-1 hold the K-1 inputs before the chunk; the chunk's rows
    are written at P..P+L-1 (from ``x_refs``, [L, w_i] each, side by side on lanes: the
    block's channels [q_j | k_j | v_j]). Rows from ``length`` on hold other tokens: no output
    row or context row reads them. Returns y f32[L, cb] (zero from row ``length`` on) and the
    last K-1 inputs seen, f32[K-1, cb], which are also left in rows P-(K-1)..P-1 for the next
    chunk.
    """
    K, L, P = geom.K, geom.L, geom.ctx_rows
    base = P - (K - 1)
    c0 = 0
    for x_ref in x_refs:
        width = x_ref.shape[-1]
        ext[P : P + L, c0 : c0 + width] = x_ref[...].astype(F32)
        c0 += width
    x_dtype = x_refs[0].dtype
    w = w_ref[...].astype(F32)  # [K, cb]
    taps = [ext[base + i : base + i + L, :] for i in range(K)]  # tap i: input K-1-i steps back
    y = conv_act(taps, [w[i : i + 1] for i in range(K)], w_ref.dtype, x_dtype)
    y = jnp.where(lax.broadcasted_iota(jnp.int32, (L, 1), 0) < length, y, 0.0)
    e = ext[...]  # f32[P+L, cb]
    rows = lax.broadcasted_iota(jnp.int32, e.shape, 0)
    ctx = jnp.concatenate([jnp.sum(jnp.where(rows == base + length + i, e, 0.0), axis=0,
                                   keepdims=True) for i in range(K - 1)], axis=0)
    ext[base:P, :] = ctx
    return y, ctx


def _chunk_gates(a_ref, b_ref, alog_ref, dtb_ref, length):
    """Gates of one chunk, zero past ``length``: cumulative log-decay gam f32[L, hb] (time on
    sublanes), its transpose f32[hb, L], and beta f32[L, hb]."""
    L = a_ref.shape[0]
    g, beta = gates(a_ref[...], b_ref[...], alog_ref[...], dtb_ref[...])  # f32[L, hb]
    live = lax.broadcasted_iota(jnp.int32, (L, 1), 0) < length
    g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    row = lax.broadcasted_iota(jnp.int32, (L, L), 0)
    col = lax.broadcasted_iota(jnp.int32, (L, L), 1)
    gam = _dot((row >= col).astype(F32), g)  # gam[i, h] = sum_{j<=i} g[j, h]
    return gam, gam.T, beta


def _bdot_general(x, y, dims, mm):
    """Batched matmul, f32 result. mm: operand dtype; F32 keeps full precision (HIGHEST), a
    16-bit dtype casts both operands to it (one MXU pass, f32 accumulation)."""
    if mm == F32:
        return lax.dot_general(x, y, dims, precision=HI, preferred_element_type=F32)
    return lax.dot_general(x.astype(mm), y.astype(mm), dims, preferred_element_type=F32)


def _bdot(x, y, mm=F32):  # [h, m, k] @ [h, k, n], batched over the leading (head) dim
    return _bdot_general(x, y, (((2,), (1,)), ((0,), (0,))), mm)


def _bdot_nt(x, y, mm=F32):  # [h, m, k] @ [h, n, k]^T
    return _bdot_general(x, y, (((2,), (2,)), ((0,), (0,))), mm)


def _bdot_tn(x, y, mm=F32):  # [h, k, m]^T @ [h, k, n]
    return _bdot_general(x, y, (((1,), (1,)), ((0,), (0,))), mm)


def _split_bf16(a):
    """f32 a -> (a_hi, a_lo), two bf16 parts with a_hi + a_lo = a to about 16 mantissa bits.

    a_hi is a with the low 16 bits of its f32 pattern cleared (exact in bf16, and a - a_hi is
    exact in f32). A bit mask, not an f32 -> bf16 -> f32 round trip: with the round trip, the
    inverse compiled by XLA:TPU measured the one-pass error on a v5e (6.9e-3 under stress
    instead of 3e-5), as if the round trip were folded away (a_lo = 0); nothing folds a mask.
    The mask split measured within 1e-4 on the chip, under XLA and inside a Pallas kernel.
    """
    bits = lax.bitcast_convert_type(a, jnp.int32) & jnp.int32(-65536)  # 0xFFFF0000
    hi = lax.bitcast_convert_type(bits, F32)
    return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def _bdot_3pass(x_parts, y_parts):
    """[h, m, k] @ [h, k, n] from operands already split by ``_split_bf16``, as three one-pass
    bf16 products with f32 accumulation: x_hi y_hi + x_hi y_lo + x_lo y_hi (the dropped
    x_lo y_lo term is ~2^-16 of the product)."""
    (x_hi, x_lo), (y_hi, y_lo) = x_parts, y_parts
    bf = jnp.bfloat16
    return _bdot(x_hi, y_hi, bf) + (_bdot(x_hi, y_lo, bf) + _bdot(x_lo, y_hi, bf))


def _stack(xs):
    """Equal-shaped arrays [a, b] -> [len(xs), a, b] (a new leading, untiled dim)."""
    return jnp.concatenate([x[None] for x in xs], axis=0)


def _c_mask(row, col, b):
    """The C blocks of the 2b-blocking of [L, L]: rows and columns in one 2b block, not in
    one b block (row, col: iotas)."""
    return (row // (2 * b) == col // (2 * b)) & (row // b != col // b)


REFINE_STEPS = 2  # Newton steps after the one-pass doubling (stress error: 1 step 1.5e-4, 2 steps 2.6e-5)


def unit_lower_inverse(n, three_pass=False):
    """(I + n)^-1 of each strictly lower-triangular f32[L, L] of n f32[h, L, L], by doubling.

    With X the inverse's diagonal blocks of size b (X = I for b = 1), each 2b block
    [[A, 0], [C, B]] of I + n has inverse [[A^-1, 0], [-B^-1 C A^-1, B^-1]], i.e.
    X <- X - X n_C X with n_C the C blocks of n (masked with iotas; X is block diagonal, so
    the products land in the C blocks only). ceil(log2 L) doublings, the first one free
    (X = I - n_C): 2 ceil(log2 L) - 2 dependent [L, L] matmuls (10 at L = 64) instead of L - 1
    sequential row substitutions. Every intermediate is a part of the exact inverse, so,
    unlike the equally short product (I - n)(I + n^2)(I + n^4)..., no large powers of n
    cancel (keys nearly parallel, beta and decay near 1: that product loses every digit;
    see ``tests/kernels/test_gdn.py``). Plain jnp: runs outside a kernel too.

    three_pass (the bf16-activation kernel): the doubling's products in one bf16 pass each,
    then ``REFINE_STEPS`` Newton steps X <- X + X E with E = I - (I + n) X. E is strictly
    lower triangular, so a step squares it exactly ((I + n) X' = I - E^2); the residual's
    n X takes three bf16 passes (``_bdot_3pass``), the correction X E one (E is small). 10 + 2 x 4
    one-pass products instead of 30 (each doubling's two in three passes); near f32 all the same
    (2.6e-5 of max |inverse| under stress, as with three passes throughout; one pass alone 5.6e-3).
    On a v5e the 397B chunked prefill took 3.426 ms with it (2026-12-07, bench_kernels.py
    --only gdn/prefill), 4.046 ms with three passes (the same case, the session before).
    """
    L = n.shape[-1]
    row = lax.broadcasted_iota(jnp.int32, (1, L, L), 1)  # masks broadcast over heads
    col = lax.broadcasted_iota(jnp.int32, (1, L, L), 2)
    eye = (row == col).astype(F32)
    mm = jnp.bfloat16 if three_pass else F32
    x = eye - jnp.where(_c_mask(row, col, 1), n, 0.0)
    b = 2
    while b < L:
        c_blocks = jnp.where(_c_mask(row, col, b), n, 0.0)  # n in the C blocks of the 2b-blocking
        x = x - _bdot(x, _bdot(c_blocks, x, mm), mm)
        b *= 2
    if three_pass:
        n_parts = _split_bf16(n)
        for _ in range(REFINE_STEPS):
            x_parts = _split_bf16(x)
            e = eye - x - _bdot_3pass(n_parts, x_parts)
            x = x + _bdot(x_parts[0], e.astype(jnp.bfloat16), jnp.bfloat16)
    return x


def _per_head(x, hb):
    """f32[L, hb] gate columns -> f32[hb, L, 1] (head h's column as a sublane vector)."""
    return _stack([x[:, h : h + 1] for h in range(hb)])


def _per_value_head(x, rep):
    """f32[kb, ...] per qk head -> f32[kb * rep, ...] per value head (value head h reads qk
    head h // rep)."""
    return _stack([x[h // rep] for h in range(x.shape[0] * rep)])


def _chunk_delta_rule(q, k, v, gam, gam_t, beta, s_f32, o_ref, rep, mm):
    """UT/WY chunked delta rule for the block's heads, one chunk, batched over heads.

    q, k f32[kb, L, Dk] per qk head; v f32[hb, L, Dv] per value head (hb = kb * rep);
    gam f32[L, hb], gam_t f32[hb, L], beta f32[L, hb]; s_f32 f32[hb, Dk, Dv] state (read and
    updated); writes o_ref [L, hb * Dv] (head h on lanes h*Dv:(h+1)*Dv: rows already in
    token order for the wrapper's row gather). Q K^T and K K^T are formed once per qk head.
    mm: operand dtype of every matmul but the inverse's: bf16 with bf16 activations, as
    flash-linear-attention does (f32 accumulation; the state itself stays f32), F32 (full
    precision) otherwise. The inverse stays near f32: full precision with F32, three bf16
    passes a product with bf16 (``_bdot_3pass``; 3e-5 relative under stress).
    """
    L, hb = gam.shape
    row = lax.broadcasted_iota(jnp.int32, (1, L, L), 1)
    col = lax.broadcasted_iota(jnp.int32, (1, L, L), 2)
    gcol, bcol = _per_head(gam, hb), _per_head(beta, hb)  # f32[hb, L, 1]
    grow = _stack([gam_t[h : h + 1, :] for h in range(hb)])  # f32[hb, 1, L]
    decay = jnp.exp(jnp.where(row >= col, gcol - grow, -jnp.inf))  # f32[hb, L, L]
    kk = _per_value_head(_bdot_nt(k, k, mm), rep)  # f32[hb, L, L]
    qk = _per_value_head(_bdot_nt(q, k, mm), rep)
    qh, kh = _per_value_head(q, rep), _per_value_head(k, rep)  # f32[hb, L, Dk]
    n = jnp.where(row > col, bcol * kk * decay, 0.0)  # strictly lower
    t_inv = unit_lower_inverse(n, three_pass=mm != F32)
    s = s_f32[...]  # f32[hb, Dk, Dv]
    u = _bdot(t_inv, v * bcol, mm)  # [hb, L, Dv]
    w = _bdot(t_inv, kh * (bcol * jnp.exp(gcol)), mm)  # [hb, L, Dk]
    v_new = u - _bdot(w, s, mm)
    o = _bdot(qh * jnp.exp(gcol), s, mm) + _bdot(qk * decay, v_new, mm)  # [hb, L, Dv]
    g_last = gcol[:, L - 1 :, :]  # [hb, 1, 1]
    s_f32[...] = s * jnp.exp(g_last) + _bdot_tn(kh * jnp.exp(g_last - gcol), v_new, mm)
    Dv = o.shape[2]
    for h in range(hb):
        o_ref[:, h * Dv : (h + 1) * Dv] = o[h].astype(o_ref.dtype)


def _chunk_kernel(
    # Scalar prefetch
    layer_ref,  # i32[1] layer of the stacked states
    len_ref,  # i32[N] tokens in each chunk
    slot_ref,  # i32[N] state slot of each chunk's request
    flags_ref,  # i32[N] VALID | FIRST | LAST | FRESH
    # Inputs
    alog_ref, dtb_ref,  # f32[1, hb] this head block's A_log, dt_bias
    *refs,
    geom, num_x,
):
    # Inputs, continued: num_x refs of this chunk's pre-conv channels of the block, [L, w_i]
    #   side by side making [L, cb] (rows from the chunk's length on hold other tokens);
    #   a_ref, b_ref [L, hb] gate inputs; w_ref [K, cb] conv weights of the block; cs_hbm,
    #   rs_hbm [Lyr, S, rows, C], [Lyr, S, Hv, Dk, Dv] (ANY; aliased to cs_out, rs_out).
    # Outputs: o_ref [L, hb * Dv]; cs_out, rs_out.
    # Scratch: ext f32[P+L, cb] conv context (rows P-(K-1)..P-1) then this chunk's inputs;
    #   cs_io [rows, cb] conv state staging in its dtype (rows K-1.. are padding); s_f32
    #   f32[hb, Dk, Dv] recurrent state, carried across a request's chunks; s_io
    #   [hb, Dk, Dv] its staging in the state dtype; sems: DMA semaphores.
    x_refs, refs = refs[:num_x], refs[num_x:]
    (a_ref, b_ref, w_ref, cs_hbm, rs_hbm, o_ref, cs_out, rs_out, ext, cs_io, s_f32, s_io,
     sems) = refs
    j, n = pl.program_id(0), pl.program_id(1)
    flags, length = flags_ref[n], len_ref[n]
    valid, first = (flags & VALID) != 0, (flags & FIRST) != 0
    last, fresh = (flags & LAST) != 0, (flags & FRESH) != 0
    copies = functools.partial(_state_copies, geom, j, layer_ref[0], slot_ref[n])
    P, K = geom.ctx_rows, geom.K

    @pl.when(valid & first & fresh)
    def _():
        ext[P - (K - 1) : P, :] = jnp.zeros((K - 1, geom.cb), F32)
        s_f32[...] = jnp.zeros(s_f32.shape, F32)

    @pl.when(valid & first & jnp.logical_not(fresh))
    def _():
        _dma_all(copies(cs_hbm, rs_hbm, cs_io, s_io), sems)
        ext[P - (K - 1) : P, :] = cs_io[0 : K - 1, :].astype(F32)
        s_f32[...] = s_io[...].astype(F32)

    @pl.when(valid)
    def _():
        y, ctx = _chunk_conv(ext, x_refs, w_ref, length, geom)  # f32[L, cb], f32[K-1, cb]
        qs, ks, vs = _block_heads(y, geom)
        q, k = (_stack(x[:: geom.rep]) for x in (qs, ks))  # f32[kb, L, Dk]
        gam, gam_t, beta = _chunk_gates(a_ref, b_ref, alog_ref, dtb_ref, length)
        mm = jnp.bfloat16 if x_refs[0].dtype == jnp.bfloat16 else F32  # matmul operands
        _chunk_delta_rule(q, k, _stack(vs), gam, gam_t, beta, s_f32, o_ref, geom.rep, mm)

        @pl.when(last)
        def _():
            cs_io[...] = jnp.zeros(cs_io.shape, cs_io.dtype)  # padding rows stored as zeros
            cs_io[0 : K - 1, :] = ctx.astype(cs_io.dtype)
            s_io[...] = s_f32[...].astype(s_io.dtype)
            _dma_all([(vmem, hbm) for hbm, vmem in copies(cs_out, rs_out, cs_io, s_io)], sems)

    @pl.when(jnp.logical_not(valid))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


# ----------------------------------------------------------------------------- wrapper


def _to_blocks(x, geom):
    """[..., C] channels [q | k | v] -> [..., nb, cb], block j = [q_j | k_j | v_j]."""
    lead, kd = x.shape[:-1], geom.Hk * geom.Dk
    q = x[..., :kd].reshape(*lead, geom.nb, geom.kb * geom.Dk)
    k = x[..., kd : 2 * kd].reshape(*lead, geom.nb, geom.kb * geom.Dk)
    v = x[..., 2 * kd :].reshape(*lead, geom.nb, geom.hb * geom.Dv)
    return jnp.concatenate([q, k, v], axis=-1)


def _column_blocks(geom):
    """(q, k, v) block indices of head block 0's channels in a row of C, in units of the
    block's q, k and v widths, when those widths are lane-aligned (multiples of 128) and tile
    their sections; else None."""
    qk_w, v_w = geom.kb * geom.Dk, geom.hb * geom.Dv
    if qk_w % 128 or v_w % 128 or (2 * geom.Hk * geom.Dk) % v_w:
        return None
    return 0, geom.Hk // geom.kb, 2 * geom.Hk * geom.Dk // v_w


def _chunk_x_inputs(x, geom, per_step):
    """The chunk kernel's x operands and BlockSpecs from the chunks' rows x [N, L, C].

    Lane-aligned blocks (``_column_blocks``): x itself three times, with one BlockSpec each
    for the block's q, k and v columns, so XLA makes no copy of it. Otherwise: one array
    [nb, N, L, cb], block j = [q_j | k_j | v_j] (``_to_blocks``; a transposing copy).
    """
    sq, L = pl.Squeezed(), geom.L
    cols = _column_blocks(geom)
    if cols is None:
        return [jnp.moveaxis(_to_blocks(x, geom), 2, 0)], [per_step(L, geom.cb)]
    widths = (geom.kb * geom.Dk, geom.kb * geom.Dk, geom.hb * geom.Dv)
    specs = [pl.BlockSpec((sq, L, w), lambda j, i, *_, c=c: (i, 0, c + j))
             for w, c in zip(widths, cols)]
    return [x, x, x], specs


def _head_blocks(x, geom):
    """[..., Hv] -> [..., nb, hb]."""
    return x.reshape(*x.shape[:-1], geom.nb, geom.hb)


def pallas_gdn(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
               cu_q_lens, kv_lens, state_slots, num_seqs, layer, *, geom: Geometry,
               decode: bool, cost, interpret):
    """Run the decode or chunk kernel; arguments as ``gdn.gated_delta_net`` (``layer``
    an i32 scalar, already clipped to the stacked layers)."""
    T = mixed_qkv.shape[0]
    R = state_slots.shape[0]
    nb, hb, cb, Dv, K, L = geom.nb, geom.hb, geom.cb, geom.Dv, geom.K, geom.L
    sq = pl.Squeezed()
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    alog = _head_blocks(A_log.astype(F32), geom)[:, None, :]  # f32[nb, 1, hb]
    dtb = _head_blocks(dt_bias.astype(F32), geom)[:, None, :]
    w = jnp.moveaxis(_to_blocks(conv_weight.T, geom), 1, 0)  # [nb, K, cb]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    def per_block(*shape):  # block j of an [nb, *shape] array, the same at every step
        return pl.BlockSpec((sq, *shape), lambda j, i, *_: (j,) + (0,) * len(shape))

    def per_step(*shape):  # block (j, step i) of an [nb, steps, *shape] array
        return pl.BlockSpec((sq, sq, *shape), lambda j, i, *_: (j, i) + (0,) * len(shape))

    if decode:
        rb = geom.rb
        steps, kernel = -(-T // rb), _decode_kernel
        pad = steps * rb - T  # padding rows: flags 0, slot 0, zero inputs; never move state
        slots, kvl, real = decode_rows(kv_lens, state_slots, num_seqs, T)
        flags = (real * VALID + (real & (kvl <= 1)) * FRESH).astype(jnp.int32)
        prefetch = (layer, jnp.pad(slots.astype(jnp.int32), (0, pad)), jnp.pad(flags, (0, pad)))
        rows = lambda z: jnp.pad(z, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731 axis 1
        x_in = rows(jnp.moveaxis(_to_blocks(mixed_qkv, geom), 1, 0)[:, :, None, :])
        a_in, b_in = (rows(jnp.moveaxis(_head_blocks(z, geom), 1, 0)[:, :, None, :])
                      for z in (a, b))  # x_in [nb, T', 1, cb], a_in, b_in [nb, T', 1, hb]

        def per_rows(*shape):  # block (j, step i) of an [nb, T', *shape] array: rb rows
            return pl.BlockSpec((sq, rb, *shape), lambda j, i, *_: (j, i) + (0,) * len(shape))

        x_args, x_specs = [x_in], [per_rows(1, cb)]
        ab_spec, o_spec = per_rows(1, hb), per_rows(hb, Dv)
        o_shape = (nb, steps * rb, hb, Dv)
        scratch = [pltpu.VMEM((2, rb, conv_state.shape[2], cb), conv_state.dtype),
                   pltpu.VMEM((2, rb, hb, geom.Dk, Dv), rec_state.dtype),
                   pltpu.SemaphoreType.DMA((2, 2, rb, _NUM_SEMS))]
        vmem = decode_vmem_limit(geom, rec_state.dtype.itemsize, conv_state.dtype.itemsize)
    else:
        N = num_chunk_slots(T, R, L)
        lay = chunk_layout(cu_q_lens, kv_lens, state_slots, num_seqs, L, N)
        prefetch = (layer, lay.length, lay.slot, lay.flags)
        steps, kernel = N, _chunk_kernel
        # Each chunk's rows [N, L, *], gathered whole; rows past a chunk's length hold other
        # tokens, which the kernel never reads into an output.
        idx = jnp.clip(lay.start[:, None] + jnp.arange(L)[None, :], 0, T - 1)  # i32[N, L]
        x_args, x_specs = _chunk_x_inputs(mixed_qkv[idx], geom, per_step)
        kernel = functools.partial(_chunk_kernel, num_x=len(x_args))
        a_in, b_in = (jnp.moveaxis(_head_blocks(z[idx], geom), 2, 0)  # [nb, N, L, hb]
                      for z in (a, b))
        ab_spec = per_step(L, hb)
        # Output rows in chunk order with the head blocks side by side on lanes: [N, L, Hv*Dv]
        # (hb*Dv is a multiple of 128 or all of Hv*Dv: block_error), block (chunk i, block j).
        o_spec = pl.BlockSpec((sq, L, hb * Dv), lambda j, i, *_: (i, 0, j))
        o_shape = (N, L, geom.Hv * Dv)
        scratch = [pltpu.VMEM((geom.ctx_rows + L, cb), F32),
                   pltpu.VMEM((conv_state.shape[2], cb), conv_state.dtype),
                   pltpu.VMEM((hb, geom.Dk, Dv), F32),
                   pltpu.VMEM((hb, geom.Dk, Dv), rec_state.dtype),
                   pltpu.SemaphoreType.DMA((_NUM_SEMS,))]
        vmem = chunk_vmem_limit(geom)

    n_pre, n_x = len(prefetch), len(x_args)
    o, conv_state, rec_state = pl.pallas_call(
        functools.partial(kernel, geom=geom),
        out_shape=(jax.ShapeDtypeStruct(o_shape, mixed_qkv.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_pre,
            # Grid (head block, decode row | chunk): a request's chunks are consecutive steps
            # of one head block, so its state stays in VMEM scratch between them.
            grid=(nb, steps),
            in_specs=[per_block(1, hb), per_block(1, hb), *x_specs, ab_spec, ab_spec,
                      per_block(K, cb), any_spec, any_spec],
            out_specs=[o_spec, any_spec, any_spec],
            scratch_shapes=scratch),
        input_output_aliases={n_pre + n_x + 5: 1, n_pre + n_x + 6: 2},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem),
        cost_estimate=cost,
        interpret=interpret,
    )(*prefetch, alog, dtb, *x_args, a_in, b_in, w, conv_state, rec_state)

    if decode:
        return jnp.moveaxis(o[:, :T], 1, 0).reshape(T, geom.Hv, Dv), conv_state, rec_state
    req, pos, valid = token_meta(cu_q_lens, num_seqs, T)
    chunk = jnp.clip(lay.first_chunk[req] + pos // L, 0, N - 1)  # i32[T]
    # One gather of whole rows. Gathering o[:, chunk, :, pos % L] from an [nb, N, hb, L, Dv]
    # output (two index arrays around a sliced dim) made XLA:TPU fuse a SparseCore gather into
    # out_proj that fails to compile for tpu7x once T > 1024 (gather_emitter RET_CHECK:
    # operand and output tilings differ).
    o = o.reshape(N * L, geom.Hv, Dv)[chunk * L + pos % L]  # [T, Hv, Dv]
    return jnp.where(valid[:, None, None], o, jnp.zeros((), o.dtype)), conv_state, rec_state
