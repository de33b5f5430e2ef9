"""Fused causal conv1d + Gated DeltaNet over a ragged batch, with per-request state slots.

One call runs a GDN layer's token mixer for one step: the depthwise
causal conv over the pre-conv ``[q | k | v]`` channels (taking the K-1 previous inputs of each
request from its conv state slot), SiLU, per-head l2 norm of q and k, the gates, and the gated
delta rule from the request's recurrent state slot. Output is before the gated RMSNorm.

Dimension letters: T tokens, R requests, S state slots, Lyr GDN layers, C conv channels
(2*Hk*Dk + Hv*Dv), K conv taps, Hk qk heads, Hv value heads (value head j reads qk head
j // (Hv // Hk)), Dk / Dv head dims, N chunks, L chunk length.

States: one array each for all GDN layers, ``conv_state [Lyr, S, rows, C]`` (rows 0..K-2 hold
the last K-1 pre-conv inputs, oldest first, channels last; ``rows = conv_state_rows(K)`` pads
K-1 to a power of two so that XLA:TPU keeps the array row-major, the layout the kernels DMA
from; padding rows stay zero) and ``rec_state [Lyr, S, Hv, Dk, Dv]`` (fp32
or bf16). ``layer`` (a Python int or a traced i32 scalar, e.g. a ``lax.scan`` index) picks
the layer; only the slots of that layer's real requests are written, everything else is
returned bit-identical, and no implementation copies a whole layer.

Numerics follow transformers' ``Qwen3_5MoeGatedDeltaNet``: the conv output is rounded to the
weight dtype before SiLU and to the input dtype after it; q/k are l2-normalised in fp32
(eps 1e-6, ``x * rsqrt(sum(x^2) + eps)``), q is scaled by Dk^-0.5; ``beta = sigmoid(b)`` in
b's dtype; ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32; the recurrence is fp32 and
the recurrent state is stored back in its own dtype (fp32 or bf16).

Implementations (``impl``, see ``kernels/dispatch.py``; the Pallas kernels are in
``kernels/gdn_kernels.py``, the math they share with the references in ``kernels/gdn_common.py``):
  * ``decode=True``: one token per request, row r is request r. A vectorised recurrent step
    using ``o = q.S_pre + (q.k) d`` (S_pre the decayed state), so o does not wait on the
    rank-1 update. Off the Pallas path it runs as :func:`decode_loop`, the loop body that
    speculative verify mode (``kernels/gdn_verify.py``) runs once per verified position.
  * ``decode=False``: ragged prefill chunks and decode rows mixed. Each request's tokens are
    cut into chunks of ``chunk_size``; the chunks of all requests are laid out in a static
    number of chunk slots ``N = min(T, cdiv(T, L) + R)``, and a scan over chunks carries each
    request's state (UT/WY chunked form).
  * ``impl="xla"`` (what ``"auto"`` picks off-TPU): the reference with ``XLA_CHUNK_SIZE``-token
    chunks unless ``chunk_size`` is given. The chunk's unit-lower inverse is a loop of L
    matrix-vector rows, and XLA:CPU pays per iteration, so a chunk shorter than the Pallas
    kernels' makes a prefill step cheaper there (``benchmarks/bench_gdn_chunk.py`` times one
    mixed step per chunk size).

State slots: rows ``r >= num_seqs`` and real requests with no tokens leave their slots
untouched. A request with ``kv_lens[r] == q_len[r]`` is fresh: its slots are read as zeros.
Output rows of padding tokens are zero.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import block_tables, dispatch, gdn_geometry
from . import gdn_kernels
from .cost import Cost
from .gdn_common import (F32, HI, VALID, L2NORM_EPS, chunk_layout, conv_act, conv_state_rows,
                         decode_rows, gates, l2norm, num_chunk_slots, request_meta, token_meta)

__all__ = ["CHUNK_SIZE", "GdnBlockSizes", "L2NORM_EPS", "XLA_CHUNK_SIZE", "gated_delta_net",
           "gated_delta_net_cost", "num_chunk_slots", "ref_gated_delta_net", "ref_recurrent_gdn"]


CHUNK_SIZE = 64  # chunk of the Pallas kernels and the reference
XLA_CHUNK_SIZE = 32  # chunk of the XLA (CPU / GPU serving) path, see the module docstring


@dataclasses.dataclass(frozen=True)
class GdnBlockSizes:
    """Tiling of the Pallas kernels.

    A grid step owns ``k_heads_per_block`` qk heads and the ``k_heads_per_block * Hv / Hk``
    value heads that read them, so the q/k conv channels of different steps never overlap.
    The block's q, k and v channel widths must be multiples of 128 lanes, or the block must
    hold all heads. None: for the chunked kernel the smallest such block of at least 16 value
    heads (``gdn_geometry.default_chunk_k_heads_per_block``) -- at 397B shapes (Hk=16,
    Hv=64, D=128) 4 qk heads and 16 value heads (a 1 MiB fp32 state block, q/k segments of
    512 lanes, a v segment of 2048); all heads when D < 128. For the decode kernel the
    smallest whose state block is at least 256 KiB
    (``gdn_geometry.default_decode_k_heads_per_block``): 2 qk heads with a bf16 state.

    A fatter block means fewer grid steps of the chunk kernel, which runs the block's heads as
    batched matmuls; its VMEM grows with the block (compile reports at 397B shapes, L=64, bf16
    activations, fp32 state: 2.9 / 5.3 / 10.2 / 19.9 / 40.2 MiB on v5e at kb = 1 / 2 / 4 / 8 /
    16, and 2.5 / 9.1 / 19.4 / 40.2 MiB on TPU7x at kb = 1 / 4 / 8 / 16), and its scoped limit
    follows (``gdn_kernels.chunk_vmem_limit``).

    ``rows_per_step`` (rb, the decode kernel only): decode rows per grid step. A grid step has
    a fixed cost (its BlockSpec DMAs of x, a, b and o, the step itself; ~1.8 us on a v5e at
    397B shapes against 0.32 us for one row's bf16 state traffic), which rb rows share; the
    state scratch holds 2 * rb rows' state blocks. None: ``gdn_geometry.DEFAULT_ROWS_PER_STEP``
    (8) halved until the VMEM estimate fits (``gdn_geometry.default_rows_per_step``), and at
    most T; the rows are padded to a multiple of rb.
    """

    k_heads_per_block: int | None = None
    rows_per_step: int | None = None


# ----------------------------------------------------------------------------- shared math


def _split_heads(y, num_k_heads, num_v_heads, dk, dv):
    """y f32[..., C] -> q, k f32[..., Hv, Dk] (normed, q scaled, repeated), v f32[..., Hv, Dv]."""
    lead = y.shape[:-1]
    kd = num_k_heads * dk
    q = l2norm(y[..., :kd].reshape(*lead, num_k_heads, dk)) * (dk**-0.5)
    k = l2norm(y[..., kd : 2 * kd].reshape(*lead, num_k_heads, dk))
    v = y[..., 2 * kd :].reshape(*lead, num_v_heads, dv)
    rep = num_v_heads // num_k_heads
    return jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2), v


def _decode_step(s, q, k, v, g, beta):
    """One delta-rule step, rearranged. s f32[B, Dk, Dv]; q, k [B, 1, Dk]; v [B, 1, Dv]; g, beta [B, 1, 1].

    Returns (o f32[B, 1, Dv], s_new): o = q.S_pre + (q.k) d with S_pre = exp(g) S and
    d = beta (v - k.S_pre), which equals (S_pre + k d^T)^T q without waiting on the update.
    """
    s = s * jnp.exp(g)
    ks = jnp.einsum("bxk,bkv->bxv", k, s, precision=HI, preferred_element_type=F32)
    qs = jnp.einsum("bxk,bkv->bxv", q, s, precision=HI, preferred_element_type=F32)
    d = beta * (v - ks)
    o = qs + jnp.sum(q * k, axis=-1, keepdims=True) * d
    s = s + jnp.einsum("bxk,bxv->bkv", k, d, precision=HI, preferred_element_type=F32)
    return o, s


def _layer_index(layer, num_layers):
    """The layer as an i32 scalar; a traced one is clipped to [0, Lyr) (a static one is checked)."""
    return jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)


def _initial_states(conv_state, rec_state, layer, state_slots, fresh, num_taps):
    """f32 conv windows [R, K-1, C] (``num_taps`` = K-1 rows of the padded slot) and recurrent
    states [R, Hv, Dk, Dv] of ``layer``; zeros when fresh. Gathers only the R slots."""
    slots = jnp.clip(state_slots, 0, conv_state.shape[1] - 1)
    cs = jnp.where(fresh[:, None, None], 0.0, conv_state[layer, slots, :num_taps].astype(F32))
    rs = jnp.where(fresh[:, None, None, None], 0.0, rec_state[layer, slots].astype(F32))
    return cs, rs


def _store_states(conv_state, rec_state, layer, state_slots, write, new_cs, new_rs):
    """Scatter per-request states into their slots of ``layer``; rows with write=False are dropped."""
    idx = jnp.where(write, state_slots, conv_state.shape[1])
    conv_state = conv_state.at[layer, idx, :new_cs.shape[1]].set(new_cs.astype(conv_state.dtype),
                                                                 mode="drop")
    rec_state = rec_state.at[layer, idx].set(new_rs.astype(rec_state.dtype), mode="drop")
    return conv_state, rec_state


# ----------------------------------------------------------------------------- references


def ref_recurrent_gdn(
    mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
    cu_q_lens, kv_lens, state_slots, num_seqs, *, num_k_heads: int, layer=0,
):
    """Ground truth: a token-by-token scan in transformers' order (update S, then o = S^T q).

    Same arguments and results as :func:`gated_delta_net`; slow (one scan step per token).
    """
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, 1, False, layer)
    T, C = mixed_qkv.shape
    Lyr, _, Hv, Dk, Dv = rec_state.shape
    K = conv_weight.shape[1]
    R = state_slots.shape[0]
    layer = _layer_index(layer, Lyr)
    q_len, real, fresh = request_meta(cu_q_lens, kv_lens, num_seqs)
    req, _, valid = token_meta(cu_q_lens, num_seqs, T)
    cs0, rs0 = _initial_states(conv_state, rec_state, layer, state_slots, fresh, K - 1)
    win0 = jnp.concatenate([cs0, jnp.zeros((1, K - 1, C), F32)])  # row R: sink for padding
    st0 = jnp.concatenate([rs0, jnp.zeros((1, Hv, Dk, Dv), F32)])
    w = conv_weight.astype(F32)  # f32[C, K]

    def step(carry, xs):
        win, st = carry
        r, x_t, a_t, b_t = xs
        full = jnp.concatenate([win[r], x_t.astype(F32)[None, :]], axis=0)  # f32[K, C]
        y = conv_act([full[j] for j in range(K)], [w[:, j] for j in range(K)],
                     conv_weight.dtype, mixed_qkv.dtype)
        q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)  # [Hv, D]
        g, beta = gates(a_t, b_t, A_log, dt_bias)  # f32[Hv]
        s = st[r] * jnp.exp(g)[:, None, None]
        kv_mem = jnp.einsum("hk,hkv->hv", k, s, precision=HI)
        d = (v - kv_mem) * beta[:, None]
        s = s + k[:, :, None] * d[:, None, :]
        o = jnp.einsum("hk,hkv->hv", q, s, precision=HI)
        return (win.at[r].set(full[1:]), st.at[r].set(s)), o

    r_eff = jnp.where(valid, req, R)
    (win, st), o = lax.scan(step, (win0, st0), (r_eff, mixed_qkv, a, b))
    o = jnp.where(valid[:, None, None], o, 0.0).astype(mixed_qkv.dtype)
    conv_state, rec_state = _store_states(conv_state, rec_state, layer, state_slots, real,
                                          win[:R], st[:R])
    return o, conv_state, rec_state


def decode_loop(win0, s0, x, a, b, conv_weight, A_log, dt_bias, num_k_heads, once,
                state_dtype, conv_dtype, live=None):
    """Decode steps of R requests: step i feeds token i of every request.

    win0 f32[R, K-1, C] conv windows; s0 f32[R, Hv, Dk, Dv] states; x [n, R, C]; a, b
    [n, R, Hv]; ``once`` a traced i32 scalar equal to 1; ``live`` bool[n, R] or None (all
    true): request r takes step i only where ``live[i, r]`` (its state and window stay as they
    are otherwise). Returns o f32[n, R, Hv, Dv], the last state [R, Hv, Dk, Dv] in
    ``state_dtype`` (each step's state rounded to it, as a slot stores it) and the last window
    f32[R, K-1, C] (inputs rounded through ``conv_dtype``).

    Each step is a loop of one iteration over the same body, in the decode path (n = 1), in
    verify mode and in its commit (n = k+1): XLA compiles a loop body on its own, so a verify
    or commit position rounds exactly like a decode step (``live`` selects between whole
    results outside the body). Fusing the steps with each other or with their surroundings
    would change float32 rounding on XLA:CPU (multiply-adds, the l2 norms' reductions).
    ``once`` must be read from an input: XLA inlines a loop it can prove runs once.
    """
    n, R, C = x.shape
    _, Hv, Dk, Dv = s0.shape
    K = conv_weight.shape[1]
    w = conv_weight.astype(F32)

    def step(_, carry):
        win, s, x_in, a_i, b_i, _o = carry
        x_i = x_in.astype(F32)
        y = conv_act([win[:, j] for j in range(K - 1)] + [x_i], [w[:, j] for j in range(K)],
                     conv_weight.dtype, x.dtype)  # f32[R, C]
        q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)
        g, beta = gates(a_i, b_i, A_log, dt_bias)  # f32[R, Hv]
        o, s = _decode_step(s.reshape(R * Hv, Dk, Dv), q.reshape(R * Hv, 1, Dk),
                            k.reshape(R * Hv, 1, Dk), v.reshape(R * Hv, 1, Dv),
                            g.reshape(R * Hv, 1, 1), beta.reshape(R * Hv, 1, 1))
        s = s.reshape(R, Hv, Dk, Dv).astype(state_dtype).astype(F32)
        win = jnp.concatenate([win[:, 1:], x_i.astype(conv_dtype).astype(F32)[:, None]], axis=1)
        return win, s, x_in, a_i, b_i, o.reshape(R, Hv, Dv)

    win, s, outs = win0, s0, []
    for i in range(n):
        carry = (win, s, x[i], a[i], b[i], jnp.zeros((R, Hv, Dv), F32))
        new_win, new_s, _, _, _, o = lax.fori_loop(0, once, step, carry)
        if live is None:
            win, s = new_win, new_s
        else:
            win = jnp.where(live[i][:, None, None], new_win, win)
            s = jnp.where(live[i][:, None, None, None], new_s, s)
        outs.append(o)
    return jnp.stack(outs), s.astype(state_dtype), win


def _ref_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                kv_lens, state_slots, num_seqs, num_k_heads, layer):
    """decode=True reference: row t is request t with exactly one token."""
    K = conv_weight.shape[1]
    slots, kvl, real = decode_rows(kv_lens, state_slots, num_seqs, mixed_qkv.shape[0])
    cs0, rs0 = _initial_states(conv_state, rec_state, layer, slots, kvl <= 1, K - 1)
    once = jnp.where(num_seqs[0] >= 0, 1, 0)  # 1 (num_seqs >= 0), traced: see decode_loop
    o, s, win = decode_loop(cs0, rs0, mixed_qkv[None], a[None], b[None], conv_weight, A_log,
                            dt_bias, num_k_heads, once, rec_state.dtype, conv_state.dtype)
    o = jnp.where(real[:, None, None], o[0], 0.0).astype(mixed_qkv.dtype)
    conv_state, rec_state = _store_states(conv_state, rec_state, layer, slots, real, win, s)
    return o, conv_state, rec_state


def _ragged_conv(mixed_qkv, conv_weight, cs0, cu_q_lens, q_len, num_seqs):
    """Causal conv + SiLU over ragged requests. Returns y f32[T, C], new windows f32[R, K-1, C]."""
    T, C = mixed_qkv.shape
    K = conv_weight.shape[1]
    req, pos, _ = token_meta(cu_q_lens, num_seqs, T)
    x = mixed_qkv.astype(F32)
    ch = jnp.arange(C)[None, :]

    def tap(d, owner, p, base):  # input d steps before position p of request `owner`, [*, C]
        from_x = x[jnp.clip(base + p - d, 0, T - 1)]
        from_h = cs0[owner[:, None], jnp.clip(K - 1 + p - d, 0, K - 2)[:, None], ch]
        return jnp.where((p - d >= 0)[:, None], from_x, from_h)

    taps = [tap(K - 1 - j, req, pos, cu_q_lens[req]) for j in range(K)]
    w = conv_weight.astype(F32)
    y = conv_act(taps, [w[:, j] for j in range(K)], conv_weight.dtype, mixed_qkv.dtype)
    reqs = jnp.arange(q_len.shape[0])
    new_cs = jnp.stack([tap(0, reqs, q_len - (K - 1) + i, cu_q_lens[:-1]) for i in range(K - 1)], 1)
    return y, new_cs


def _unit_lower_inverse(n):
    """(I + n)^-1 for strictly lower-triangular n: f32[..., L, L], by forward substitution.

    Row i of the inverse is ``-n[i] + (-n[i]) @ inv[:i]`` once rows < i are final. Written as
    a loop of matrix-vector products rather than ``lax.linalg.triangular_solve``: on XLA:CPU
    the LAPACK solve runs on the intra-op pool and two independent solves in one program can
    wait on each other forever on a 2-core host.
    """
    L = n.shape[-1]

    def row(i, a):
        r = a[..., i, :]  # f32[..., L], zero from column i on
        return a.at[..., i, :].set(r + jnp.einsum("...j,...jk->...k", r, a, precision=HI))

    a = lax.fori_loop(1, L, row, -n)
    return a + jnp.eye(L, dtype=n.dtype)


def _ref_chunked(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                 cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, layer):
    """decode=False reference: chunked (UT/WY) gated delta rule over a ragged batch.

    A loop over the chunks in use (a traced count; a request's chunks run in order), each
    doing its whole chunk: gather its rows [Hv, L, ...], the intra-chunk UT transform, then
    output and state update from its request's running state. The static chunk-slot bound
    ``num_chunk_slots`` (T/L + R) only sizes buffers, so a padded request bucket costs no
    work: the loop runs over the chunks real tokens fill, not over all N slots.
    """
    T, _ = mixed_qkv.shape
    _, _, Hv, Dk, Dv = rec_state.shape
    R = state_slots.shape[0]
    L = chunk_size
    q_len, real, fresh = request_meta(cu_q_lens, kv_lens, num_seqs)
    cs0, rs0 = _initial_states(conv_state, rec_state, layer, state_slots, fresh,
                               conv_weight.shape[1] - 1)
    y, new_cs = _ragged_conv(mixed_qkv, conv_weight, cs0, cu_q_lens, q_len, num_seqs)
    q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)  # f32[T, Hv, D]
    g, beta = gates(a, b, A_log, dt_bias)  # f32[T, Hv]

    N = num_chunk_slots(T, R, L)
    lay = chunk_layout(cu_q_lens, kv_lens, state_slots, num_seqs, L, N)
    idx = lay.start[:, None] + jnp.arange(L)[None, :]  # i32[N, L]
    live = jnp.arange(L)[None, :] < lay.length[:, None]  # bool[N, L]

    tril = jnp.tril(jnp.ones((L, L), bool))

    def step(n, carry):  # chunk n of its request: output rows, then the request's new state
        states, oc = carry
        rows = jnp.clip(idx[n], 0, T - 1)  # i32[L]
        keep = live[n]  # bool[L]

        def chunk(x):  # [T, Hv, ...] -> [Hv, L, ...], zero past the chunk's length
            xc = jnp.where(keep.reshape(L, *([1] * (x.ndim - 1))), x[rows], 0.0)
            return jnp.moveaxis(xc, 0, 1)

        qc, kc, vc, gc, bc = (chunk(t) for t in (q, k, v, g, beta))
        gam = jnp.cumsum(gc, axis=-1)  # f32[Hv, L]
        decay = jnp.exp(jnp.where(tril, gam[:, :, None] - gam[:, None, :], -jnp.inf))
        kb = kc * bc[..., None]
        kk = jnp.einsum("hid,hjd->hij", kb, kc, precision=HI) * decay
        ut_inv = _unit_lower_inverse(jnp.where(jnp.tril(tril, -1), kk, 0.0))
        u = jnp.einsum("hij,hjv->hiv", ut_inv, vc * bc[..., None], precision=HI)  # f32[Hv, L, Dv]
        w = jnp.einsum("hij,hjk->hik", ut_inv, kb * jnp.exp(gam)[..., None], precision=HI)
        attn = jnp.einsum("hid,hjd->hij", qc, kc, precision=HI) * decay
        r = lay.req[n]
        s = states[r]
        v_new = u - jnp.einsum("hck,hkv->hcv", w, s, precision=HI)
        o = (jnp.einsum("hck,hkv->hcv", qc * jnp.exp(gam)[..., None], s, precision=HI)
             + jnp.einsum("hij,hjv->hiv", attn, v_new, precision=HI))
        kd = kc * jnp.exp(gam[:, -1:] - gam)[..., None]
        s = s * jnp.exp(gam[:, -1])[:, None, None] + jnp.einsum("hck,hcv->hkv", kd, v_new,
                                                                 precision=HI)
        return states.at[r].set(s), oc.at[n].set(o)

    # Only the chunks in use (a traced count: the valid chunks come first); a padded request
    # bucket adds chunk slots, not work.
    num_used = jnp.sum((lay.flags & VALID) > 0)
    states, oc = lax.fori_loop(0, num_used, step, (rs0, jnp.zeros((N, Hv, L, Dv), F32)))
    oc = jnp.moveaxis(oc, 1, 2)  # f32[N, L, Hv, Dv]
    o = jnp.zeros((T, Hv, Dv), F32).at[jnp.where(live, idx, T)].set(oc, mode="drop")
    conv_state, rec_state = _store_states(conv_state, rec_state, layer, state_slots, real,
                                          new_cs, states)
    return o.astype(mixed_qkv.dtype), conv_state, rec_state


def ref_gated_delta_net(
    mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
    cu_q_lens, kv_lens, state_slots, num_seqs, *, num_k_heads: int, decode: bool = False,
    chunk_size: int = CHUNK_SIZE, layer=0,
):
    """Pure-JAX reference of :func:`gated_delta_net` (same arguments, no ``impl``)."""
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode,
                layer)
    layer = _layer_index(layer, rec_state.shape[0])
    if decode:
        return _ref_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                           kv_lens, state_slots, num_seqs, num_k_heads, layer)
    return _ref_chunked(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                        cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size,
                        layer)


# ----------------------------------------------------------------------------- validation


def _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode,
                layer, block_sizes: GdnBlockSizes | None = None):
    shapes = (f"mixed_qkv {mixed_qkv.shape}, a {a.shape}, b {b.shape}, conv_weight "
              f"{conv_weight.shape}, A_log {A_log.shape}, dt_bias {dt_bias.shape}, conv_state "
              f"{conv_state.shape}, rec_state {rec_state.shape}, cu_q_lens {cu_q_lens.shape}, "
              f"kv_lens {kv_lens.shape}, state_slots {state_slots.shape}, num_seqs "
              f"{num_seqs.shape}, num_k_heads={num_k_heads}, chunk_size={chunk_size}")

    def need(ok, what):
        if not ok:
            raise ValueError(f"gated_delta_net: {what}; got {shapes}")

    need(mixed_qkv.ndim == 2 and mixed_qkv.shape[0] >= 1, "mixed_qkv must be [T>=1, C]")
    need(rec_state.ndim == 5, "rec_state must be [Lyr, S, Hv, Dk, Dv]")
    T, C = mixed_qkv.shape
    Lyr, S, Hv, Dk, Dv = rec_state.shape
    need(isinstance(num_k_heads, int) and num_k_heads >= 1 and Hv % num_k_heads == 0,
         "num_k_heads must be a positive divisor of Hv")
    need(C == 2 * num_k_heads * Dk + Hv * Dv, "C must equal 2*Hk*Dk + Hv*Dv")
    need(a.shape == (T, Hv) and b.shape == (T, Hv), "a and b must be [T, Hv]")
    need(conv_weight.ndim == 2 and conv_weight.shape[0] == C and conv_weight.shape[1] >= 2,
         "conv_weight must be [C, K>=2]")
    need(conv_state.shape == (Lyr, S, conv_state_rows(conv_weight.shape[1]), C),
         "conv_state must be [Lyr, S, conv_state_rows(K), C] (Lyr, S as rec_state)")
    need(A_log.shape == (Hv,) and dt_bias.shape == (Hv,), "A_log and dt_bias must be [Hv]")
    need(cu_q_lens.ndim == 1 and cu_q_lens.shape[0] >= 2, "cu_q_lens must be [R+1], R >= 1")
    R = cu_q_lens.shape[0] - 1
    need(kv_lens.shape == (R,) and state_slots.shape == (R,), "kv_lens, state_slots must be [R]")
    need(num_seqs.shape == (1,), "num_seqs must be [1]")
    for name, arr in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens),
                      ("state_slots", state_slots), ("num_seqs", num_seqs)):
        need(jnp.issubdtype(arr.dtype, jnp.integer), f"{name} must be an integer array")
    for name, arr in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("conv_weight", conv_weight),
                      ("conv_state", conv_state), ("rec_state", rec_state)):
        need(jnp.issubdtype(arr.dtype, jnp.floating), f"{name} must be floating point")
    need(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size must be a positive int")
    if isinstance(layer, (int, np.integer)):
        need(0 <= layer < Lyr, f"layer must be in [0, Lyr), got {layer}")
    else:
        need(jnp.ndim(layer) == 0 and jnp.issubdtype(jnp.result_type(layer), jnp.integer),
             "layer must be an int or an integer scalar")
    if block_sizes is not None and block_sizes.k_heads_per_block is not None:
        err = gdn_kernels.block_error(num_k_heads, Hv, Dk, Dv, block_sizes.k_heads_per_block)
        need(err is None, str(err))
    if block_sizes is not None and block_sizes.rows_per_step is not None:
        err = gdn_geometry.rows_error(block_sizes.rows_per_step)
        need(err is None, str(err))


# ----------------------------------------------------------------------------- public API


def gated_delta_net(
    mixed_qkv,  # [T, C] pre-conv in_proj_qkv outputs, channels [q | k | v]
    a,  # [T, Hv] in_proj_a outputs
    b,  # [T, Hv] in_proj_b outputs
    conv_weight,  # [C, K] depthwise causal conv weights, no bias
    A_log,  # f32[Hv]
    dt_bias,  # f32[Hv]
    conv_state,  # [Lyr, S, conv_state_rows(K), C] last K-1 pre-conv inputs per layer and slot, oldest first
    rec_state,  # [Lyr, S, Hv, Dk, Dv] recurrent state per layer and slot (fp32 or bf16)
    cu_q_lens,  # i32[R+1] request r owns rows cu_q_lens[r]:cu_q_lens[r+1]
    kv_lens,  # i32[R] tokens of the request after this step (== q_len: fresh request)
    state_slots,  # i32[R] state slot of each request
    num_seqs,  # i32[1] real requests
    *, num_k_heads: int, decode: bool = False, chunk_size: int | None = None, layer=0,
    impl=None, block_sizes: GdnBlockSizes | None = None,
):
    """Fused causal conv1d + Gated DeltaNet for one step of a ragged batch.

    Args:
      mixed_qkv ... num_seqs: as annotated above. With ``decode=True`` every request has one
        token and row t belongs to request t (``cu_q_lens`` is not read).
      num_k_heads: Hk; Lyr, S, Hv, Dk, Dv come from ``rec_state``.
      decode: static; recurrent single-token path instead of the chunked path.
      chunk_size: static chunk length of the chunked path (a multiple of 8 on TPU is best);
        default ``CHUNK_SIZE``, ``XLA_CHUNK_SIZE`` on the XLA path.
      layer: the GDN layer to read and update: a Python int or a traced i32 scalar (the Pallas
        kernels receive it by scalar prefetch; a traced value is clipped to [0, Lyr)).
      impl: see ``kernels/dispatch.py``; static under jit.
      block_sizes: tiling of the Pallas kernels.

    Returns:
      o [T, Hv, Dv] in mixed_qkv's dtype (before the gated RMSNorm; zero on padding rows),
      the updated conv_state and rec_state (the full stacked arrays, same shapes and dtypes;
      other layers and the slots of padding rows bit-identical).
    """
    block_sizes = block_sizes or GdnBlockSizes()
    resolved = dispatch.resolve(impl, has_xla=True)
    if chunk_size is None:
        chunk_size = XLA_CHUNK_SIZE if resolved == "xla" else CHUNK_SIZE
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode,
                layer, block_sizes)
    if resolved in ("reference", "xla"):
        return ref_gated_delta_net(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state,
                                   rec_state, cu_q_lens, kv_lens, state_slots, num_seqs,
                                   num_k_heads=num_k_heads, decode=decode, chunk_size=chunk_size,
                                   layer=layer)
    T = mixed_qkv.shape[0]
    Lyr, _, Hv, Dk, Dv = rec_state.shape
    K = conv_weight.shape[1]
    kb, rb = _block_sizes(block_sizes, T, num_k_heads, Hv, Dk, Dv, K,
                          rec_state.dtype.itemsize, conv_state.dtype.itemsize, decode)
    geom = gdn_kernels.Geometry(Hk=num_k_heads, Hv=Hv, Dk=Dk, Dv=Dv, K=K, kb=kb,
                                L=1 if decode else chunk_size, rb=rb)
    cost = gated_delta_net_cost(T, state_slots.shape[0], num_k_heads, Hv, Dk, Dv,
                                conv_kernel=K, decode=decode, chunk_size=chunk_size,
                                x_bytes=mixed_qkv.dtype.itemsize,
                                state_bytes=rec_state.dtype.itemsize).to_pallas()
    return gdn_kernels.pallas_gdn(
        mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, cu_q_lens,
        kv_lens, state_slots, num_seqs, _layer_index(layer, Lyr), geom=geom, decode=decode,
        cost=cost, interpret=dispatch.interpret_params(resolved))


def _block_sizes(given: GdnBlockSizes, T, Hk, Hv, Dk, Dv, K, state_bytes, x_bytes, decode):
    """(kb, rb) of a call: the caller's fields where given, else this TPU generation's table
    overrides where legal (``block_tables.pick``), else the shape's defaults (decode: the
    head block of ``gdn_geometry.default_decode_k_heads_per_block``; chunked: that of
    ``gdn_geometry.default_chunk_k_heads_per_block``).
    A table rb is capped at T; one over the VMEM cap, or none, gives the default rb of the
    chosen kb."""
    kb, rb = given.k_heads_per_block, given.rows_per_step
    if kb is not None and rb is not None:
        return kb, rb

    def legal(b):
        return (gdn_kernels.block_error(Hk, Hv, Dk, Dv, b.k_heads_per_block) is None
                and (b.rows_per_step is None or gdn_geometry.rows_error(b.rows_per_step) is None))

    if kb is not None:
        kb0 = kb
    elif decode:
        kb0 = gdn_geometry.default_decode_k_heads_per_block(Hk, Hv, Dk, Dv, state_bytes)
    else:
        kb0 = gdn_geometry.default_chunk_k_heads_per_block(Hk, Hv, Dk, Dv)
    picked = block_tables.pick("gdn", GdnBlockSizes(kb0, rb), legal)
    kb = kb if kb is not None else picked.k_heads_per_block
    if rb is not None:
        return kb, rb
    geom = gdn_kernels.Geometry(Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, K=K, kb=kb, L=1)
    rb = picked.rows_per_step
    if rb is None or not gdn_geometry.decode_fits(geom, rb, state_bytes, x_bytes):
        return kb, gdn_geometry.default_rows_per_step(geom, T, state_bytes, x_bytes)
    return kb, min(rb, T)


def gated_delta_net_cost(
    num_tokens: int, num_seqs: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
    head_v_dim: int, *, conv_kernel: int = 4, decode: bool = False, chunk_size: int = 64,
    x_bytes: int = 2, state_bytes: int = 4,
) -> Cost:
    """Analytic cost of one call (conv + gates + delta rule; the touched state slots of one
    layer read and written once; other layers and slots are not touched)."""
    T, R, Hv, Dk, Dv, K = num_tokens, num_seqs, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    C = 2 * num_k_heads * Dk + Hv * Dv
    conv = 2 * T * C * K
    if decode:
        mix = T * Hv * 8 * Dk * Dv  # decay, k.S, q.S, rank-1 update
    else:
        L = chunk_size
        n = num_chunk_slots(T, R, L)
        per_chunk = (4 * L * L * Dk  # K K^T, Q K^T
                     + L * L * L  # unit-lower inverse, as a substitution (the Pallas
                     # kernel's log-depth doubling spends (4 log2 L - 4) L^3 on the MXU)
                     + 2 * L * L * (Dv + Dk)  # u, w
                     + 6 * L * Dk * Dv  # w S, q S, K^T v_new
                     + 2 * L * L * Dv)  # attn v_new
        mix = n * Hv * per_chunk
    state_rw = 2 * R * (Hv * Dk * Dv * state_bytes + C * (K - 1) * x_bytes)
    io = T * (C + 2 * Hv + Hv * Dv) * x_bytes + C * K * x_bytes + 8 * Hv
    transc = T * (2 * C + 4 * Hv + 2 * num_k_heads)
    return Cost(flops=conv + mix, bytes_accessed=state_rw + io, transcendentals=transc)
