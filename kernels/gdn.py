"""Fused causal conv1d + Gated DeltaNet over a ragged batch, with per-request state slots.

One call runs a GDN layer's token mixer for one step (DESIGN.md section 2): the depthwise
causal conv over the pre-conv ``[q | k | v]`` channels (taking the K-1 previous inputs of each
request from its conv state slot), SiLU, per-head l2 norm of q and k, the gates, and the gated
delta rule from the request's recurrent state slot. Output is before the gated RMSNorm.

Dimension letters: T tokens, R requests, S state slots, C conv channels (2*Hk*Dk + Hv*Dv),
K conv taps, Hk qk heads, Hv value heads (value head j reads qk head j // (Hv // Hk)),
Dk / Dv head dims, N chunks, L chunk length.

Numerics follow transformers' ``Qwen3_5MoeGatedDeltaNet``: the conv output is rounded to the
weight dtype before SiLU and to the input dtype after it; q/k are l2-normalised in fp32
(eps 1e-6, ``x * rsqrt(sum(x^2) + eps)``), q is scaled by Dk^-0.5; ``beta = sigmoid(b)`` in
b's dtype; ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32; the recurrence is fp32 and
the recurrent state is stored back in its own dtype (fp32 or bf16).

Implementations (``impl``, see ``kernels.dispatch``):
  * ``decode=True``: one token per request, row r is request r. A vectorised recurrent step
    using ``o = q.S_pre + (q.k) d`` (S_pre the decayed state), so o does not wait on the
    rank-1 update.
  * ``decode=False``: ragged prefill chunks and decode rows mixed. Each request's tokens are
    cut into chunks of ``chunk_size``; the chunks of all requests are laid out in a static
    number of chunk slots ``N = min(T, cdiv(T, L) + R)``, and a scan over chunks carries each
    request's state (UT/WY chunked form).

State slots: rows ``r >= num_seqs`` and real requests with no tokens leave their slots
untouched. A request with ``kv_lens[r] == q_len[r]`` is fresh: its slots are read as zeros.
Output rows of padding tokens are zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch
from kernels.cost import Cost

L2NORM_EPS = 1e-6  # transformers' l2norm eps for q and k
_F32 = jnp.float32
_HI = lax.Precision.HIGHEST  # f32 matmuls in the kernels must not drop to bf16 passes
# Chunk flags (scalar-prefetched, one i32 per chunk or decode row).
_VALID, _FIRST, _LAST, _FRESH = 1, 2, 4, 8


@dataclasses.dataclass(frozen=True)
class GdnBlockSizes:
    """Tiling of the Pallas kernels.

    A grid step owns ``k_heads_per_block`` qk heads and the ``k_heads_per_block * Hv / Hk``
    value heads that read them, so the q/k conv channels of different steps never overlap.
    At 397B shapes (Hk=16, Hv=64, D=128) one qk head gives 4 value heads: a 256 KiB fp32
    state block, q/k segments of 128 lanes and a v segment of 512 lanes.
    """

    k_heads_per_block: int = 1


# ----------------------------------------------------------------------------- shared math


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _gates(a, b, A_log, dt_bias):
    """f32 (g, beta) from a, b [..., Hv] and f32 A_log, dt_bias broadcastable to them."""
    beta = _sigmoid(b.astype(_F32)).astype(b.dtype).astype(_F32)
    g = -jnp.exp(A_log.astype(_F32)) * _softplus(a.astype(_F32) + dt_bias.astype(_F32))
    return g, beta


def _conv_act(taps, w_cols, w_dtype, x_dtype):
    """Depthwise conv + SiLU: sum_j taps[j] * w_cols[j] (oldest tap first) in fp32."""
    acc = taps[0] * w_cols[0]
    for tap, w in zip(taps[1:], w_cols[1:]):
        acc = acc + tap * w
    y = acc.astype(w_dtype).astype(_F32)
    y = y * _sigmoid(y)
    return y.astype(x_dtype).astype(_F32)


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _split_heads(y, num_k_heads, num_v_heads, dk, dv):
    """y f32[..., C] -> q, k f32[..., Hv, Dk] (normed, q scaled, repeated), v f32[..., Hv, Dv]."""
    lead = y.shape[:-1]
    kd = num_k_heads * dk
    q = _l2norm(y[..., :kd].reshape(*lead, num_k_heads, dk)) * (dk**-0.5)
    k = _l2norm(y[..., kd : 2 * kd].reshape(*lead, num_k_heads, dk))
    v = y[..., 2 * kd :].reshape(*lead, num_v_heads, dv)
    rep = num_v_heads // num_k_heads
    return jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2), v


def _decode_step(s, q, k, v, g, beta):
    """One delta-rule step, rearranged. s f32[B, Dk, Dv]; q, k [B, 1, Dk]; v [B, 1, Dv]; g, beta [B, 1, 1].

    Returns (o f32[B, 1, Dv], s_new): o = q.S_pre + (q.k) d with S_pre = exp(g) S and
    d = beta (v - k.S_pre), which equals (S_pre + k d^T)^T q without waiting on the update.
    """
    s = s * jnp.exp(g)
    ks = jnp.einsum("bxk,bkv->bxv", k, s, precision=_HI, preferred_element_type=_F32)
    qs = jnp.einsum("bxk,bkv->bxv", q, s, precision=_HI, preferred_element_type=_F32)
    d = beta * (v - ks)
    o = qs + jnp.sum(q * k, axis=-1, keepdims=True) * d
    s = s + jnp.einsum("bxk,bxv->bkv", k, d, precision=_HI, preferred_element_type=_F32)
    return o, s


def _request_meta(cu_q_lens, kv_lens, num_seqs):
    """i32 q_len[R], bool real[R] (a real request with tokens), bool fresh[R]."""
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    real = (jnp.arange(q_len.shape[0]) < num_seqs[0]) & (q_len > 0)
    return q_len, real, (kv_lens - q_len) <= 0


def _token_meta(cu_q_lens, num_seqs, num_tokens):
    """i32 req[T] (owning request, clipped), i32 pos[T] (index inside this step), bool valid[T]."""
    num_reqs = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens)
    req = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_reqs - 1)
    end = cu_q_lens[jnp.clip(num_seqs[0], 0, num_reqs)]
    return req, t - cu_q_lens[req], t < end


def num_chunk_slots(num_tokens: int, num_reqs: int, chunk_size: int) -> int:
    """Static bound on the chunks of a ragged batch: sum_r cdiv(q_len_r, L) <= this."""
    return max(1, min(num_tokens, -(-num_tokens // chunk_size) + num_reqs))


def _chunk_layout(cu_q_lens, kv_lens, state_slots, num_seqs, chunk_size, num_chunks):
    """Chunk n -> (req, start token, length, slot, flags); all i32[N]. Chunks are in token order."""
    num_reqs = cu_q_lens.shape[0] - 1
    q_len, real, fresh = _request_meta(cu_q_lens, kv_lens, num_seqs)
    per_req = jnp.where(real, -(-q_len // chunk_size), 0)
    chunk_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_req).astype(jnp.int32)])
    n = jnp.arange(num_chunks)
    req = jnp.clip(jnp.searchsorted(chunk_cu, n, side="right") - 1, 0, num_reqs - 1)
    valid = n < chunk_cu[-1]
    i = n - chunk_cu[req]
    start = jnp.where(valid, cu_q_lens[req] + i * chunk_size, 0)
    length = jnp.where(valid, jnp.clip(q_len[req] - i * chunk_size, 0, chunk_size), 0)
    flags = (
        valid * _VALID
        + (valid & (i == 0)) * _FIRST
        + (valid & (i == per_req[req] - 1)) * _LAST
        + (valid & fresh[req]) * _FRESH
    )
    return req, start.astype(jnp.int32), length.astype(jnp.int32), state_slots[req], flags.astype(jnp.int32)


def _initial_states(conv_state, rec_state, state_slots, fresh):
    """f32 conv windows [R, C, K-1] and recurrent states [R, Hv, Dk, Dv]; zeros when fresh."""
    slots = jnp.clip(state_slots, 0, conv_state.shape[0] - 1)
    cs = jnp.where(fresh[:, None, None], 0.0, conv_state[slots].astype(_F32))
    rs = jnp.where(fresh[:, None, None, None], 0.0, rec_state[slots].astype(_F32))
    return cs, rs


def _store_states(conv_state, rec_state, state_slots, write, new_cs, new_rs):
    """Scatter per-request states into their slots; rows with write=False are dropped."""
    idx = jnp.where(write, state_slots, conv_state.shape[0])
    conv_state = conv_state.at[idx].set(new_cs.astype(conv_state.dtype), mode="drop")
    rec_state = rec_state.at[idx].set(new_rs.astype(rec_state.dtype), mode="drop")
    return conv_state, rec_state


# ----------------------------------------------------------------------------- references


def ref_recurrent_gdn(
    mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
    cu_q_lens, kv_lens, state_slots, num_seqs, *, num_k_heads: int,
):
    """Ground truth: a token-by-token scan in transformers' order (update S, then o = S^T q).

    Same arguments and results as :func:`gated_delta_net`; slow (one scan step per token).
    """
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, 1, False)
    T, C = mixed_qkv.shape
    _, Hv, Dk, Dv = rec_state.shape
    K = conv_weight.shape[1]
    R = state_slots.shape[0]
    q_len, real, fresh = _request_meta(cu_q_lens, kv_lens, num_seqs)
    req, _, valid = _token_meta(cu_q_lens, num_seqs, T)
    cs0, rs0 = _initial_states(conv_state, rec_state, state_slots, fresh)
    win0 = jnp.concatenate([cs0, jnp.zeros((1, C, K - 1), _F32)])  # row R: sink for padding
    st0 = jnp.concatenate([rs0, jnp.zeros((1, Hv, Dk, Dv), _F32)])
    w = conv_weight.astype(_F32)  # f32[C, K]

    def step(carry, xs):
        win, st = carry
        r, x_t, a_t, b_t = xs
        full = jnp.concatenate([win[r], x_t.astype(_F32)[:, None]], axis=1)  # f32[C, K]
        y = _conv_act([full[:, j] for j in range(K)], [w[:, j] for j in range(K)],
                      conv_weight.dtype, mixed_qkv.dtype)
        q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)  # [Hv, D]
        g, beta = _gates(a_t, b_t, A_log, dt_bias)  # f32[Hv]
        s = st[r] * jnp.exp(g)[:, None, None]
        kv_mem = jnp.einsum("hk,hkv->hv", k, s, precision=_HI)
        d = (v - kv_mem) * beta[:, None]
        s = s + k[:, :, None] * d[:, None, :]
        o = jnp.einsum("hk,hkv->hv", q, s, precision=_HI)
        return (win.at[r].set(full[:, 1:]), st.at[r].set(s)), o

    r_eff = jnp.where(valid, req, R)
    (win, st), o = lax.scan(step, (win0, st0), (r_eff, mixed_qkv, a, b))
    o = jnp.where(valid[:, None, None], o, 0.0).astype(mixed_qkv.dtype)
    conv_state, rec_state = _store_states(conv_state, rec_state, state_slots, real, win[:R], st[:R])
    return o, conv_state, rec_state


def _ref_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                kv_lens, state_slots, num_seqs, num_k_heads):
    """decode=True reference: row t is request t with exactly one token."""
    T, C = mixed_qkv.shape
    _, Hv, Dk, Dv = rec_state.shape
    K = conv_weight.shape[1]
    slots, kvl, real = _decode_rows(kv_lens, state_slots, num_seqs, T)
    cs0, rs0 = _initial_states(conv_state, rec_state, slots, kvl <= 1)
    full = jnp.concatenate([cs0, mixed_qkv.astype(_F32)[:, :, None]], axis=2)  # f32[T, C, K]
    w = conv_weight.astype(_F32)
    y = _conv_act([full[..., j] for j in range(K)], [w[:, j] for j in range(K)],
                  conv_weight.dtype, mixed_qkv.dtype)  # f32[T, C]
    q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)
    g, beta = _gates(a, b, A_log, dt_bias)  # f32[T, Hv]
    o, s = _decode_step(rs0.reshape(T * Hv, Dk, Dv), q.reshape(T * Hv, 1, Dk),
                        k.reshape(T * Hv, 1, Dk), v.reshape(T * Hv, 1, Dv),
                        g.reshape(T * Hv, 1, 1), beta.reshape(T * Hv, 1, 1))
    o = jnp.where(real[:, None, None], o.reshape(T, Hv, Dv), 0.0).astype(mixed_qkv.dtype)
    conv_state, rec_state = _store_states(conv_state, rec_state, slots, real, full[..., 1:],
                                          s.reshape(T, Hv, Dk, Dv))
    return o, conv_state, rec_state


def _decode_rows(kv_lens, state_slots, num_seqs, num_rows):
    """Per decode row: slot, kv_len, real flag (row < R and row < num_seqs)."""
    R = state_slots.shape[0]
    rows = jnp.arange(num_rows)
    ridx = jnp.clip(rows, 0, R - 1)
    real = (rows < R) & (rows < num_seqs[0])
    return state_slots[ridx], kv_lens[ridx], real


def _ragged_conv(mixed_qkv, conv_weight, cs0, cu_q_lens, q_len, num_seqs):
    """Causal conv + SiLU over ragged requests. Returns y f32[T, C], new windows f32[R, C, K-1]."""
    T, C = mixed_qkv.shape
    K = conv_weight.shape[1]
    req, pos, _ = _token_meta(cu_q_lens, num_seqs, T)
    x = mixed_qkv.astype(_F32)
    ch = jnp.arange(C)[None, :]

    def tap(d, owner, p, base):  # input d steps before position p of request `owner`, [*, C]
        from_x = x[jnp.clip(base + p - d, 0, T - 1)]
        from_h = cs0[owner[:, None], ch, jnp.clip(K - 1 + p - d, 0, K - 2)[:, None]]
        return jnp.where((p - d >= 0)[:, None], from_x, from_h)

    taps = [tap(K - 1 - j, req, pos, cu_q_lens[req]) for j in range(K)]
    w = conv_weight.astype(_F32)
    y = _conv_act(taps, [w[:, j] for j in range(K)], conv_weight.dtype, mixed_qkv.dtype)
    reqs = jnp.arange(q_len.shape[0])
    new_cs = jnp.stack([tap(0, reqs, q_len - (K - 1) + i, cu_q_lens[:-1]) for i in range(K - 1)], -1)
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
        return a.at[..., i, :].set(r + jnp.einsum("...j,...jk->...k", r, a, precision=_HI))

    a = lax.fori_loop(1, L, row, -n)
    return a + jnp.eye(L, dtype=n.dtype)


def _ref_chunked(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                 cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size):
    """decode=False reference: chunked (UT/WY) gated delta rule over a ragged batch."""
    T, _ = mixed_qkv.shape
    _, Hv, Dk, Dv = rec_state.shape
    R = state_slots.shape[0]
    L = chunk_size
    q_len, real, fresh = _request_meta(cu_q_lens, kv_lens, num_seqs)
    cs0, rs0 = _initial_states(conv_state, rec_state, state_slots, fresh)
    y, new_cs = _ragged_conv(mixed_qkv, conv_weight, cs0, cu_q_lens, q_len, num_seqs)
    q, k, v = _split_heads(y, num_k_heads, Hv, Dk, Dv)  # f32[T, Hv, D]
    g, beta = _gates(a, b, A_log, dt_bias)  # f32[T, Hv]

    N = num_chunk_slots(T, R, L)
    req, start, length, _, flags = _chunk_layout(cu_q_lens, kv_lens, state_slots, num_seqs, L, N)
    idx = start[:, None] + jnp.arange(L)[None, :]  # i32[N, L]
    live = jnp.arange(L)[None, :] < length[:, None]  # bool[N, L]

    def chunked(x):  # [T, Hv, ...] -> [N, Hv, L, ...], zero past each chunk's length
        xc = x[jnp.clip(idx, 0, T - 1)]
        xc = jnp.where(live.reshape(N, L, *([1] * (x.ndim - 1))), xc, 0.0)
        return jnp.moveaxis(xc, 1, 2)

    qc, kc, vc, gc, bc = (chunked(t) for t in (q, k, v, g, beta))
    gam = jnp.cumsum(gc, axis=-1)  # f32[N, Hv, L]
    tril = jnp.tril(jnp.ones((L, L), bool))
    decay = jnp.exp(jnp.where(tril, gam[..., :, None] - gam[..., None, :], -jnp.inf))
    kb = kc * bc[..., None]
    kk = jnp.einsum("nhid,nhjd->nhij", kb, kc, precision=_HI) * decay
    ut_inv = _unit_lower_inverse(jnp.where(jnp.tril(jnp.ones((L, L), bool), -1), kk, 0.0))
    u = jnp.einsum("nhij,nhjv->nhiv", ut_inv, vc * bc[..., None], precision=_HI)  # f32[N, Hv, L, Dv]
    w = jnp.einsum("nhij,nhjk->nhik", ut_inv, kb * jnp.exp(gam)[..., None], precision=_HI)
    attn = jnp.einsum("nhid,nhjd->nhij", qc, kc, precision=_HI) * decay
    qd = qc * jnp.exp(gam)[..., None]
    kd = kc * jnp.exp(gam[..., -1:] - gam)[..., None]
    cdec = jnp.exp(gam[..., -1])[..., None, None]  # f32[N, Hv, 1, 1]

    def step(states, xs):
        r, u_n, w_n, qd_n, attn_n, kd_n, cd_n = xs
        s = states[r]
        v_new = u_n - jnp.einsum("hck,hkv->hcv", w_n, s, precision=_HI)
        o = (jnp.einsum("hck,hkv->hcv", qd_n, s, precision=_HI)
             + jnp.einsum("hij,hjv->hiv", attn_n, v_new, precision=_HI))
        s = s * cd_n + jnp.einsum("hck,hcv->hkv", kd_n, v_new, precision=_HI)
        return states.at[r].set(s), o

    states0 = jnp.concatenate([rs0, jnp.zeros((1, Hv, Dk, Dv), _F32)])  # row R: sink
    r_eff = jnp.where((flags & _VALID) > 0, req, R)
    states, oc = lax.scan(step, states0, (r_eff, u, w, qd, attn, kd, cdec))
    oc = jnp.moveaxis(oc, 1, 2)  # f32[N, L, Hv, Dv]
    o = jnp.zeros((T, Hv, Dv), _F32).at[jnp.where(live, idx, T)].set(oc, mode="drop")
    conv_state, rec_state = _store_states(conv_state, rec_state, state_slots, real, new_cs,
                                          states[:R])
    return o.astype(mixed_qkv.dtype), conv_state, rec_state


def ref_gated_delta_net(
    mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
    cu_q_lens, kv_lens, state_slots, num_seqs, *, num_k_heads: int, decode: bool = False,
    chunk_size: int = 64,
):
    """Pure-JAX reference of :func:`gated_delta_net` (same arguments, no ``impl``)."""
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode)
    if decode:
        return _ref_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                           kv_lens, state_slots, num_seqs, num_k_heads)
    return _ref_chunked(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                        cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size)


# ----------------------------------------------------------------------------- validation


def _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode,
                block_sizes: GdnBlockSizes | None = None):
    shapes = (f"mixed_qkv {mixed_qkv.shape}, a {a.shape}, b {b.shape}, conv_weight "
              f"{conv_weight.shape}, A_log {A_log.shape}, dt_bias {dt_bias.shape}, conv_state "
              f"{conv_state.shape}, rec_state {rec_state.shape}, cu_q_lens {cu_q_lens.shape}, "
              f"kv_lens {kv_lens.shape}, state_slots {state_slots.shape}, num_seqs "
              f"{num_seqs.shape}, num_k_heads={num_k_heads}, chunk_size={chunk_size}")

    def need(ok, what):
        if not ok:
            raise ValueError(f"gated_delta_net: {what}; got {shapes}")

    need(mixed_qkv.ndim == 2 and mixed_qkv.shape[0] >= 1, "mixed_qkv must be [T>=1, C]")
    need(rec_state.ndim == 4, "rec_state must be [S, Hv, Dk, Dv]")
    T, C = mixed_qkv.shape
    S, Hv, Dk, Dv = rec_state.shape
    need(isinstance(num_k_heads, int) and num_k_heads >= 1 and Hv % num_k_heads == 0,
         "num_k_heads must be a positive divisor of Hv")
    need(C == 2 * num_k_heads * Dk + Hv * Dv, "C must equal 2*Hk*Dk + Hv*Dv")
    need(a.shape == (T, Hv) and b.shape == (T, Hv), "a and b must be [T, Hv]")
    need(conv_weight.ndim == 2 and conv_weight.shape[0] == C and conv_weight.shape[1] >= 2,
         "conv_weight must be [C, K>=2]")
    need(conv_state.shape == (S, C, conv_weight.shape[1] - 1), "conv_state must be [S, C, K-1]")
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
    if block_sizes is not None:
        kb = block_sizes.k_heads_per_block
        need(kb >= 1 and num_k_heads % kb == 0, "k_heads_per_block must divide num_k_heads")


# ----------------------------------------------------------------------------- Pallas kernels
# TPU layout assumptions (documented, checked only in interpret mode and by lowering to Mosaic):
# Dk, Dv and the q/k/v segment widths are multiples of 128 lanes at real shapes (Dk=Dv=128);
# chunk_size is a multiple of 8 sublanes; conv states keep K-1 (=3) in the lane dim, as the
# API stores them, so their VMEM copies are lane-padded (small: [n, 3]). All HBM traffic is
# manual DMA from pl.ANY refs (ragged rows and state slots are not block-aligned); the DMAs
# of one phase are started together and then waited on, so their latencies overlap.

_NUM_SEMS = 16  # DMA semaphores: one per transfer in flight within a phase


def _dma_all(pairs, sems):
    """Start every (src, dst) copy, then wait for all of them."""
    copies = [pltpu.make_async_copy(s, d, sems.at[i]) for i, (s, d) in enumerate(pairs)]
    for cp in copies:
        cp.start()
    for cp in copies:
        cp.wait()


def _head_stack(y, num_heads, d, rep):
    """y f32[L, num_heads*d] -> f32[num_heads*rep, L, d], each head repeated rep times."""
    heads = [y[:, i * d : (i + 1) * d] for i in range(num_heads)]
    return jnp.stack([h for h in heads for _ in range(rep)])


def _segments(j, dims):
    """(first channel, width) of the q, k, v channel segments of head block j."""
    Hk, kb, rep, Dk, Dv = dims["Hk"], dims["kb"], dims["rep"], dims["Dk"], dims["Dv"]
    kh0 = j * kb
    return ((kh0 * Dk, kb * Dk), (Hk * Dk + kh0 * Dk, kb * Dk),
            (2 * Hk * Dk + kh0 * rep * Dv, kb * rep * Dv))


def _qkv_gates(ys, a_blk, b_blk, alog, dtb, dims):
    """Post-conv segments f32[L, n], gate inputs [L, hb], f32[1, hb] params ->
    q, k f32[hb, L, Dk], v f32[hb, L, Dv], g, beta f32[L, hb]."""
    kb, rep, Dk, Dv = dims["kb"], dims["rep"], dims["Dk"], dims["Dv"]
    q = _l2norm(_head_stack(ys[0], kb, Dk, rep)) * (Dk**-0.5)
    k = _l2norm(_head_stack(ys[1], kb, Dk, rep))
    v = _head_stack(ys[2], kb * rep, Dv, 1)
    g, beta = _gates(a_blk, b_blk, alog, dtb)
    return q, k, v, g, beta


def _decode_kernel(
    # Prefetch
    slots_ref,  # i32[T] state slot of each row
    flags_ref,  # i32[T] _VALID (real row) | _FRESH
    # Input
    alog_ref, dtb_ref,  # f32[1, 1, hb] this head block's A_log, dt_bias (VMEM)
    x_hbm,  # [T, C] pre-conv rows (ANY)
    a_hbm, b_hbm,  # [T, Hv] (ANY)
    w_hbm,  # [C, K] conv weights (ANY)
    cs_hbm, rs_hbm,  # [S, C, K-1], [S, Hv, Dk, Dv] (ANY, aliased to the outputs)
    # Output
    o_hbm,  # [T, Hv, Dv] (ANY)
    cs_out, rs_out,  # aliases of cs_hbm, rs_hbm
    # Scratch
    w_q, w_k, w_v,  # [n, K] weight segments, loaded once per head block
    x_q, x_k, x_v,  # [1, n] this row's segments
    c_q, c_k, c_v,  # [n, K-1] conv state segments (in and out)
    a_buf, b_buf,  # [1, hb] this row's gate inputs
    s_io,  # [hb, Dk, Dv] recurrent state block in its dtype (in and out)
    o_buf,  # [1, hb, Dv] output block
    sems,  # DMA semaphores
    *, dims,
):
    j, t = pl.program_id(0), pl.program_id(1)
    hb, K = dims["hb"], dims["K"]
    h0 = j * hb
    segs = _segments(j, dims)
    real = (flags_ref[t] & _VALID) != 0
    fresh = (flags_ref[t] & _FRESH) != 0
    slot = slots_ref[t]
    ws, xs, cs = (w_q, w_k, w_v), (x_q, x_k, x_v), (c_q, c_k, c_v)
    o_dst = o_hbm.at[pl.ds(t, 1), pl.ds(h0, hb)]
    rs_src, rs_dst = rs_hbm.at[slot, pl.ds(h0, hb)], rs_out.at[slot, pl.ds(h0, hb)]

    @pl.when(t == 0)
    def _():
        _dma_all([(w_hbm.at[pl.ds(c0, n)], wb) for (c0, n), wb in zip(segs, ws)], sems)

    @pl.when(jnp.logical_not(real))
    def _():
        o_buf[...] = jnp.zeros(o_buf.shape, o_buf.dtype)
        _dma_all([(o_buf, o_dst)], sems)

    row_loads = [(x_hbm.at[pl.ds(t, 1), pl.ds(c0, n)], xb) for (c0, n), xb in zip(segs, xs)]
    row_loads += [(a_hbm.at[pl.ds(t, 1), pl.ds(h0, hb)], a_buf),
                  (b_hbm.at[pl.ds(t, 1), pl.ds(h0, hb)], b_buf)]

    @pl.when(real & fresh)
    def _():
        for cb in cs:
            cb[...] = jnp.zeros(cb.shape, cb.dtype)
        s_io[...] = jnp.zeros(s_io.shape, s_io.dtype)
        _dma_all(row_loads, sems)

    @pl.when(real & jnp.logical_not(fresh))
    def _():
        state_loads = [(cs_hbm.at[slot, pl.ds(c0, n)], cb) for (c0, n), cb in zip(segs, cs)]
        _dma_all(row_loads + state_loads + [(rs_src, s_io)], sems)

    @pl.when(real)
    def _():
        ys = []
        for wb, xb, cb in zip(ws, xs, cs):
            window = jnp.concatenate([cb[...].astype(_F32), xb[...].astype(_F32).T], axis=1)  # [n, K]
            w = wb[...].astype(_F32)
            y = _conv_act([window[:, i : i + 1] for i in range(K)],
                          [w[:, i : i + 1] for i in range(K)], wb.dtype, xb.dtype)  # [n, 1]
            ys.append(y.T)
            cb[...] = window[:, 1:].astype(cb.dtype)
        q, k, v, g, beta = _qkv_gates(ys, a_buf[...], b_buf[...], alog_ref[0], dtb_ref[0], dims)
        o, s = _decode_step(s_io[...].astype(_F32), q, k, v, g.T[:, :, None], beta.T[:, :, None])
        s_io[...] = s.astype(s_io.dtype)
        o_buf[0] = o[:, 0, :].astype(o_buf.dtype)
        stores = [(cb, cs_out.at[slot, pl.ds(c0, n)]) for (c0, n), cb in zip(segs, cs)]
        _dma_all(stores + [(s_io, rs_dst), (o_buf, o_dst)], sems)


def _chunk_kernel(
    # Prefetch
    start_ref, len_ref, slot_ref, flags_ref,  # i32[N] chunk metadata (see _chunk_layout)
    # Input
    alog_ref, dtb_ref,  # f32[1, 1, hb] this head block's A_log, dt_bias (VMEM)
    x_hbm,  # [T + L, C] pre-conv rows, padded by one chunk (ANY)
    a_hbm, b_hbm,  # [T + L, Hv] (ANY)
    w_hbm,  # [C, K] (ANY)
    cs_hbm, rs_hbm,  # [S, C, K-1], [S, Hv, Dk, Dv] (ANY, aliased to the outputs)
    # Output
    o_hbm,  # [T + L, Hv, Dv] (ANY)
    cs_out, rs_out,
    # Scratch
    w_q, w_k, w_v,  # [n, K] weight segments, loaded once per head block
    r_q, r_k, r_v,  # [L, n] this chunk's pre-conv rows
    e_q, e_k, e_v,  # f32[K-1+L, n] conv context (rows 0..K-2) then this chunk's rows
    c_q, c_k, c_v,  # [n, K-1] conv state staging
    a_buf, b_buf,  # [L, hb] gate inputs of this chunk
    s_f32,  # f32[hb, Dk, Dv] recurrent state, carried across a request's chunks
    s_io,  # [hb, Dk, Dv] recurrent state staging in its dtype
    inv_ref,  # f32[hb, L, L] UT transform, inverted in place by forward substitution
    o_buf,  # [hb, L, Dv] output staging
    sems,  # DMA semaphores
    *, dims,
):
    j, n = pl.program_id(0), pl.program_id(1)
    hb, K, L = dims["hb"], dims["K"], dims["L"]
    h0 = j * hb
    segs = _segments(j, dims)
    ws, rs, es, cs = (w_q, w_k, w_v), (r_q, r_k, r_v), (e_q, e_k, e_v), (c_q, c_k, c_v)
    flags = flags_ref[n]
    valid, first = (flags & _VALID) != 0, (flags & _FIRST) != 0
    last, fresh = (flags & _LAST) != 0, (flags & _FRESH) != 0
    start, length, slot = start_ref[n], len_ref[n], slot_ref[n]
    rs_src, rs_dst = rs_hbm.at[slot, pl.ds(h0, hb)], rs_out.at[slot, pl.ds(h0, hb)]

    @pl.when(n == 0)
    def _():
        _dma_all([(w_hbm.at[pl.ds(c0, nc)], wb) for (c0, nc), wb in zip(segs, ws)], sems)

    @pl.when(valid & first & fresh)
    def _():
        for eb in es:
            eb[0 : K - 1, :] = jnp.zeros((K - 1, eb.shape[1]), _F32)
        s_f32[...] = jnp.zeros(s_f32.shape, _F32)

    @pl.when(valid & first & jnp.logical_not(fresh))
    def _():
        loads = [(cs_hbm.at[slot, pl.ds(c0, nc)], cb) for (c0, nc), cb in zip(segs, cs)]
        _dma_all(loads + [(rs_src, s_io)], sems)
        for cb, eb in zip(cs, es):
            eb[0 : K - 1, :] = cb[...].astype(_F32).T
        s_f32[...] = s_io[...].astype(_F32)

    @pl.when(valid)
    def _():
        loads = [(x_hbm.at[pl.ds(start, L), pl.ds(c0, nc)], rb) for (c0, nc), rb in zip(segs, rs)]
        _dma_all(loads + [(a_hbm.at[pl.ds(start, L), pl.ds(h0, hb)], a_buf),
                          (b_hbm.at[pl.ds(start, L), pl.ds(h0, hb)], b_buf)], sems)
        live = lax.broadcasted_iota(jnp.int32, (L, 1), 0) < length  # bool[L, 1]
        ys = []
        for wb, rb, eb, cb in zip(ws, rs, es, cs):
            eb[K - 1 :, :] = rb[...].astype(_F32)
            e = eb[...]
            wt = wb[...].astype(_F32).T  # [K, n]
            y = _conv_act([e[i : i + L] for i in range(K)], [wt[i : i + 1] for i in range(K)],
                          wb.dtype, rb.dtype)
            ys.append(jnp.where(live, y, 0.0))
            ctx = eb[pl.ds(length, K - 1), :]  # the last K-1 inputs seen so far
            eb[0 : K - 1, :] = ctx
            cb[...] = ctx.T.astype(cb.dtype)  # stored at the request's last chunk
        q, k, v, g, beta = _qkv_gates(ys, a_buf[...], b_buf[...], alog_ref[0], dtb_ref[0], dims)
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)  # f32[L, hb]
        row = lax.broadcasted_iota(jnp.int32, (L, L), 0)
        col = lax.broadcasted_iota(jnp.int32, (L, L), 1)
        tril = (row >= col).astype(_F32)
        dot = functools.partial(jnp.dot, precision=_HI, preferred_element_type=_F32)
        gam_r = dot(g.T, tril.T)  # f32[hb, L]: gam_r[h, i] = sum_{j<=i} g[j, h]
        gam_c = dot(tril, g)  # f32[L, hb]: the same, time on sublanes
        gam_row = jnp.stack([gam_r[h : h + 1, :] for h in range(hb)])  # [hb, 1, L]
        gam_col = jnp.stack([gam_c[:, h : h + 1] for h in range(hb)])  # [hb, L, 1]
        beta_col = jnp.stack([beta[:, h : h + 1] for h in range(hb)])  # [hb, L, 1]
        decay = jnp.exp(jnp.where(row >= col, gam_col - gam_row, -jnp.inf))  # [hb, L, L]
        bmm = functools.partial(jnp.einsum, precision=_HI, preferred_element_type=_F32)
        kb = k * beta_col
        ut = bmm("hid,hjd->hij", kb, k) * decay
        inv_ref[...] = -jnp.where(row > col, ut, 0.0)

        def substitute(i, carry):  # row i of (I + strict_tril(ut))^-1 from rows < i
            r_i = inv_ref[:, pl.ds(i, 1), :]  # [hb, 1, L]
            inv_ref[:, pl.ds(i, 1), :] = r_i + bmm("hxk,hkj->hxj", r_i, inv_ref[...])
            return carry

        lax.fori_loop(1, L, substitute, 0)
        t_inv = inv_ref[...] + (row == col).astype(_F32)
        u = bmm("hij,hjv->hiv", t_inv, v * beta_col)
        w = bmm("hij,hjd->hid", t_inv, kb * jnp.exp(gam_col))
        s = s_f32[...]
        v_new = u - bmm("hck,hkv->hcv", w, s)
        attn = bmm("hid,hjd->hij", q, k) * decay
        o = bmm("hck,hkv->hcv", q * jnp.exp(gam_col), s) + bmm("hij,hjv->hiv", attn, v_new)
        g_last = gam_col[:, L - 1 :, :]  # [hb, 1, 1]
        s = s * jnp.exp(g_last) + bmm("hck,hcv->hkv", k * jnp.exp(g_last - gam_col), v_new)
        s_f32[...] = s
        o_buf[...] = o.astype(o_buf.dtype)
        # Rows past `length` hold zeros; the next chunk (same head block, later in the grid)
        # overwrites them, and the wrapper zeroes padding rows.
        _dma_all([(o_buf.at[h], o_hbm.at[pl.ds(start, L), h0 + h]) for h in range(hb)], sems)

        @pl.when(last)
        def _():
            s_io[...] = s.astype(s_io.dtype)
            stores = [(cb, cs_out.at[slot, pl.ds(c0, nc)]) for (c0, nc), cb in zip(segs, cs)]
            _dma_all(stores + [(s_io, rs_dst)], sems)


def _scratch(dims, x_dtype, w_dtype, cs_dtype, rs_dtype, ab_dtype, decode):
    """Scratch buffers, in the order of the kernel signatures."""
    K, hb, Dk, Dv, L = dims["K"], dims["hb"], dims["Dk"], dims["Dv"], dims["L"]
    widths = [n for _, n in _segments(0, dims)]
    vm = pltpu.VMEM
    w = [vm((n, K), w_dtype) for n in widths]
    c = [vm((n, K - 1), cs_dtype) for n in widths]
    sems = pltpu.SemaphoreType.DMA((max(_NUM_SEMS, hb),))
    if decode:
        return (w + [vm((1, n), x_dtype) for n in widths] + c
                + [vm((1, hb), ab_dtype), vm((1, hb), ab_dtype), vm((hb, Dk, Dv), rs_dtype),
                   vm((1, hb, Dv), x_dtype), sems])
    return (w + [vm((L, n), x_dtype) for n in widths]
            + [vm((K - 1 + L, n), _F32) for n in widths] + c
            + [vm((L, hb), ab_dtype), vm((L, hb), ab_dtype), vm((hb, Dk, Dv), _F32),
               vm((hb, Dk, Dv), rs_dtype), vm((hb, L, L), _F32), vm((hb, L, Dv), x_dtype), sems])


def _pallas_gdn(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, *, num_k_heads, decode, chunk_size,
                block_sizes, interpret):
    T, C = mixed_qkv.shape
    _, Hv, Dk, Dv = rec_state.shape
    K = conv_weight.shape[1]
    R = state_slots.shape[0]
    kb = block_sizes.k_heads_per_block
    rep = Hv // num_k_heads
    hb = kb * rep
    num_blocks = num_k_heads // kb
    L = 1 if decode else chunk_size
    dims = dict(Hk=num_k_heads, kb=kb, rep=rep, hb=hb, Dk=Dk, Dv=Dv, K=K, L=L)
    alog = A_log.astype(_F32).reshape(num_blocks, 1, hb)
    dtb = dt_bias.astype(_F32).reshape(num_blocks, 1, hb)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    cost = gated_delta_net_cost(T, R, num_k_heads, Hv, Dk, Dv, conv_kernel=K, decode=decode,
                                chunk_size=chunk_size, x_bytes=mixed_qkv.dtype.itemsize,
                                state_bytes=rec_state.dtype.itemsize).to_pallas()
    if decode:
        slots, kvl, real = _decode_rows(kv_lens, state_slots, num_seqs, T)
        flags = (real * _VALID + (real & (kvl <= 1)) * _FRESH).astype(jnp.int32)
        prefetch = (slots.astype(jnp.int32), flags)
        rows, kernel = T, _decode_kernel
    else:
        N = num_chunk_slots(T, R, L)
        _, start, length, slots, flags = _chunk_layout(cu_q_lens, kv_lens, state_slots,
                                                       num_seqs, L, N)
        prefetch = (start, length, slots.astype(jnp.int32), flags)
        pad = lambda x: jnp.pad(x, ((0, L), (0, 0)))  # noqa: E731 (chunk DMAs read L rows)
        mixed_qkv, a, b = pad(mixed_qkv), pad(a), pad(b)
        rows, kernel = N, _chunk_kernel
    # Grid: (head block, decode row or chunk). Chunks of a request run in order on one core,
    # carrying the state in VMEM; the weight segments are loaded at the block's first step.
    gate_spec = pl.BlockSpec((1, 1, hb), lambda j, i, *_: (j, 0, 0))
    n_pre = len(prefetch)
    o, conv_state, rec_state = pl.pallas_call(
        functools.partial(kernel, dims=dims),
        out_shape=(jax.ShapeDtypeStruct((mixed_qkv.shape[0], Hv, Dv), mixed_qkv.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(rec_state.shape, rec_state.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=n_pre, grid=(num_blocks, rows),
            in_specs=[gate_spec, gate_spec] + [any_spec] * 6,
            out_specs=[any_spec] * 3,
            scratch_shapes=_scratch(dims, mixed_qkv.dtype, conv_weight.dtype, conv_state.dtype,
                                    rec_state.dtype, a.dtype, decode)),
        input_output_aliases={n_pre + 6: 1, n_pre + 7: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*prefetch, alog, dtb, mixed_qkv, a, b, conv_weight, conv_state, rec_state)
    if not decode:
        _, _, valid = _token_meta(cu_q_lens, num_seqs, T)
        o = jnp.where(valid[:, None, None], o[:T], jnp.zeros((), o.dtype))
    return o, conv_state, rec_state


# ----------------------------------------------------------------------------- public API


def gated_delta_net(
    mixed_qkv,  # [T, C] pre-conv in_proj_qkv outputs, channels [q | k | v]
    a,  # [T, Hv] in_proj_a outputs
    b,  # [T, Hv] in_proj_b outputs
    conv_weight,  # [C, K] depthwise causal conv weights, no bias
    A_log,  # f32[Hv]
    dt_bias,  # f32[Hv]
    conv_state,  # [S, C, K-1] last K-1 pre-conv inputs per slot, oldest first
    rec_state,  # [S, Hv, Dk, Dv] recurrent state per slot (fp32 or bf16)
    cu_q_lens,  # i32[R+1] request r owns rows cu_q_lens[r]:cu_q_lens[r+1]
    kv_lens,  # i32[R] tokens of the request after this step (== q_len: fresh request)
    state_slots,  # i32[R] state slot of each request
    num_seqs,  # i32[1] real requests
    *, num_k_heads: int, decode: bool = False, chunk_size: int = 64, impl=None,
    block_sizes: GdnBlockSizes | None = None,
):
    """Fused causal conv1d + Gated DeltaNet for one step of a ragged batch.

    Args:
      mixed_qkv ... num_seqs: as annotated above. With ``decode=True`` every request has one
        token and row t belongs to request t (``cu_q_lens`` is not read).
      num_k_heads: Hk; Hv, Dk, Dv come from ``rec_state``.
      decode: static; recurrent single-token path instead of the chunked path.
      chunk_size: static chunk length of the chunked path (a multiple of 8 on TPU).
      impl: see ``kernels.dispatch``; static under jit.
      block_sizes: tiling of the Pallas kernels.

    Returns:
      o [T, Hv, Dv] in mixed_qkv's dtype (before the gated RMSNorm; zero on padding rows),
      the updated conv_state and rec_state (same shapes and dtypes; slots of padding rows
      untouched).
    """
    block_sizes = block_sizes or GdnBlockSizes()
    _check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads, chunk_size, decode,
                block_sizes)
    resolved = dispatch.resolve(impl)
    if resolved == "reference":
        return ref_gated_delta_net(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state,
                                   rec_state, cu_q_lens, kv_lens, state_slots, num_seqs,
                                   num_k_heads=num_k_heads, decode=decode, chunk_size=chunk_size)
    return _pallas_gdn(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                       cu_q_lens, kv_lens, state_slots, num_seqs, num_k_heads=num_k_heads,
                       decode=decode, chunk_size=chunk_size, block_sizes=block_sizes,
                       interpret=dispatch.interpret_params(resolved))


def gated_delta_net_cost(
    num_tokens: int, num_seqs: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
    head_v_dim: int, *, conv_kernel: int = 4, decode: bool = False, chunk_size: int = 64,
    x_bytes: int = 2, state_bytes: int = 4,
) -> Cost:
    """Analytic cost of one call (conv + gates + delta rule; states read and written once)."""
    T, R, Hv, Dk, Dv, K = num_tokens, num_seqs, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    C = 2 * num_k_heads * Dk + Hv * Dv
    conv = 2 * T * C * K
    if decode:
        mix = T * Hv * 8 * Dk * Dv  # decay, k.S, q.S, rank-1 update
    else:
        L = chunk_size
        n = num_chunk_slots(T, R, L)
        per_chunk = (4 * L * L * Dk  # K K^T, Q K^T
                     + L * L * L  # forward substitution
                     + 2 * L * L * (Dv + Dk)  # u, w
                     + 6 * L * Dk * Dv  # w S, q S, K^T v_new
                     + 2 * L * L * Dv)  # attn v_new
        mix = n * Hv * per_chunk
    state_rw = 2 * R * (Hv * Dk * Dv * state_bytes + C * (K - 1) * x_bytes)
    io = T * (C + 2 * Hv + Hv * Dv) * x_bytes + C * K * x_bytes + 8 * Hv
    transc = T * (2 * C + 4 * Hv + 2 * num_k_heads)
    return Cost(flops=conv + mix, bytes_accessed=state_rw + io, transcendentals=transc)
