"""Verify mode of the fused conv1d + Gated DeltaNet: k+1 tokens per request, every prefix's state.

Speculative decoding verifies a request's last token and its k drafts (n = k+1 positions) in
one step, and only afterwards knows how many of them to keep. This op runs one GDN layer over
such a batch from each request's state slot *without writing the slot*, and returns what is
needed to set the slot to the state after any accepted prefix a in 0..n:

  * ``rec_steps [R, n, Hv, Dk, Dv]``: the recurrent state after position j of request r
    (after j+1 tokens) at ``rec_steps[r, j]``; after 0 tokens it is the slot's own state.
    In rec_state's dtype (f32 for an f32 state): each position's state is rounded to that
    dtype before the next position, as a decode step stores it, so nothing is lost by
    keeping it there.
  * ``windows [R, K-1+n, C]`` (conv_state's dtype): the conv window of the slot (K-1 rows,
    oldest first; zeros for a fresh request) followed by the request's n pre-conv inputs.
    The conv state after a tokens is ``windows[r, a : a+K-1]``: derived, not stored per
    position (it is a sliding window over the inputs).

Layout: T = R * n tokens, request r owns rows ``r*n .. r*n+n-1`` (every request, padding
requests included, has exactly n rows; n is static, ``T // R``). Requests ``r >= num_seqs``
are padding: their outputs and states are zero. A request with ``kv_lens[r] == n`` is fresh
(its slot is read as zeros), as in ``kernels.gdn``. Dimension letters and numerics as there.

Each position is one decode step in the decode path's association order
(``gdn._decode_step``: o = q.S_pre + (q.k) d). On the XLA path both run the same loop body
(``gdn.decode_loop``), and the Pallas kernel the decode kernel's math, so in float32
``rec_steps[r, a-1]`` and ``windows[r, a : a+K-1]`` equal bit for bit what a decode steps of
``gated_delta_net(decode=True)`` on the same implementation leave in the slot. The reference
agrees with both to rounding (another association order).

:func:`commit_states` then writes the accepted prefix's states into the slots of every layer.

Implementations (``impl``, ``kernels.dispatch``):
  * ``"xla"`` / ``"auto"`` off-TPU: n decode steps over all requests (``gdn.decode_loop``).
  * ``"reference"``: the ground truth, :func:`gdn.ref_recurrent_gdn` (transformers' order)
    run over every prefix length of every request (n calls; slow, obvious).
  * ``"pallas"`` / ``"interpret"``: ``gdn_verify_kernel``, one grid step per (head block,
    request) that reads the slot once, runs the n positions in VMEM and writes n states.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels import dispatch, gdn, gdn_kernels, gdn_verify_kernel
from kernels.cost import Cost
from kernels.gdn_common import F32

__all__ = ["commit_states", "gated_delta_net_verify", "gated_delta_net_verify_cost",
           "ref_gdn_verify"]


def _verify_meta(T, kv_lens, num_seqs):
    """n (static), cu_q_lens i32[R+1] of the fixed layout, real bool[R], fresh bool[R]."""
    R = kv_lens.shape[0]
    n = T // R
    cu = (jnp.arange(R + 1) * n).astype(jnp.int32)
    real = jnp.arange(R) < num_seqs[0]
    return n, cu, real, kv_lens <= n


def _check(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
           state_slots, num_seqs, num_k_heads, layer, block_sizes=None):
    T, R = mixed_qkv.shape[0], kv_lens.shape[0]
    if R < 1 or T % R:
        raise ValueError(f"gated_delta_net_verify: T ({T}) must be R * n with n = k+1 tokens "
                         f"per request, R = {R} (kv_lens {kv_lens.shape})")
    _, cu, _, _ = _verify_meta(T, kv_lens, num_seqs)
    gdn._check_args(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, cu,
                    kv_lens, state_slots, num_seqs, num_k_heads, 1, False, layer, block_sizes)


def _slot_windows(conv_state, layer, state_slots, fresh, K):
    """f32[R, K-1, C]: each request's conv state (zeros if fresh), gathered by XLA."""
    slots = jnp.clip(state_slots, 0, conv_state.shape[1] - 1)
    return jnp.where(fresh[:, None, None], 0.0, conv_state[layer, slots, : K - 1].astype(F32))


def _windows(cs0, mixed_qkv, conv_dtype, n):
    """f32[R, K-1+n, C]: the conv states cs0 [R, K-1, C] then each request's n inputs, rounded
    through the conv state's dtype (as a decode step stores them)."""
    R, _, C = cs0.shape
    x = mixed_qkv.astype(conv_dtype).astype(F32).reshape(R, n, C)
    return jnp.concatenate([cs0.astype(F32), x], axis=1)


def _xla_verify(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
                state_slots, num_seqs, num_k_heads, layer):
    """n decode steps over all R requests: the decode path's loop (``gdn.decode_loop``)."""
    T = mixed_qkv.shape[0]
    _, _, Hv, Dk, Dv = rec_state.shape
    K, R = conv_weight.shape[1], kv_lens.shape[0]
    n, _, real, fresh = _verify_meta(T, kv_lens, num_seqs)
    cs0 = _slot_windows(conv_state, layer, state_slots, fresh, K)
    win = _windows(cs0, mixed_qkv, conv_state.dtype, n)  # f32[R, K-1+n, C]
    slots = jnp.clip(state_slots, 0, rec_state.shape[1] - 1)
    s0 = jnp.where(fresh[:, None, None, None], 0.0, rec_state[layer, slots].astype(F32))
    by_position = lambda z: jnp.moveaxis(z.reshape(R, n, -1), 1, 0)  # noqa: E731 [n, R, *]
    once = jnp.where(num_seqs[0] >= 0, 1, 0)  # 1 (num_seqs >= 0), traced: see gdn.decode_loop
    o, states, _ = gdn.decode_loop(win[:, : K - 1], s0, by_position(mixed_qkv), by_position(a),
                                   by_position(b), conv_weight, A_log, dt_bias, num_k_heads,
                                   once, rec_state.dtype, conv_state.dtype)
    o = jnp.where(real[:, None, None, None], jnp.moveaxis(o, 0, 1), 0.0)
    rec_steps = jnp.where(real[:, None, None, None, None], jnp.moveaxis(states, 0, 1), 0)
    win = jnp.where(real[:, None, None], win, 0.0)
    return o.reshape(T, Hv, Dv).astype(mixed_qkv.dtype), win.astype(conv_state.dtype), rec_steps


def ref_gdn_verify(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                   kv_lens, state_slots, num_seqs, *, num_k_heads: int, layer=0):
    """Ground truth of :func:`gated_delta_net_verify`: for every prefix length p = 1..n, run
    :func:`gdn.ref_recurrent_gdn` over the first p tokens of every request and read the slot
    states it leaves (o from the full-length run). Same arguments and results."""
    _check(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
           state_slots, num_seqs, num_k_heads, layer)
    T = mixed_qkv.shape[0]
    K, R = conv_weight.shape[1], kv_lens.shape[0]
    n, _, real, fresh = _verify_meta(T, kv_lens, num_seqs)
    layer = gdn._layer_index(layer, rec_state.shape[0])
    # Each request its own scratch slot r, so the prefix runs read the original states.
    slots = jnp.clip(state_slots, 0, rec_state.shape[1] - 1)
    cs = conv_state[layer, slots][None]  # [1, R, rows, C]
    rs = rec_state[layer, slots][None]  # [1, R, Hv, Dk, Dv]
    own = jnp.arange(R, dtype=jnp.int32)
    rows = jnp.arange(T).reshape(R, n)
    o = states = None
    steps = []
    for p in range(1, n + 1):  # tokens p..n-1 of each request become padding rows at the tail
        take = rows[:, :p].reshape(-1)
        pad = lambda x: jnp.zeros_like(x).at[: R * p].set(x[take])  # noqa: E731
        cu_p = jnp.concatenate([(jnp.arange(R) * p), jnp.full((1,), R * p)]).astype(jnp.int32)
        o_p, _, states = gdn.ref_recurrent_gdn(
            pad(mixed_qkv), pad(a), pad(b), conv_weight, A_log, dt_bias, cs, rs, cu_p,
            kv_lens - n + p, own, num_seqs, num_k_heads=num_k_heads, layer=0)
        steps.append(states[0])
        o = o_p if p == n else o
    rec_steps = jnp.where(real[:, None, None, None, None], jnp.stack(steps, 1), 0)
    win = _windows(_slot_windows(conv_state, layer, state_slots, fresh, K), mixed_qkv,
                   conv_state.dtype, n)
    win = jnp.where(real[:, None, None], win, 0.0)
    return o, win.astype(conv_state.dtype), rec_steps


def gated_delta_net_verify(
    mixed_qkv,  # [T = R*n, C] pre-conv inputs, request r at rows r*n .. r*n+n-1
    a, b,  # [T, Hv] in_proj_a / in_proj_b outputs
    conv_weight,  # [C, K]
    A_log, dt_bias,  # f32[Hv]
    conv_state,  # [Lyr, S, conv_state_rows(K), C] (read only)
    rec_state,  # [Lyr, S, Hv, Dk, Dv] (read only)
    kv_lens,  # i32[R] tokens of the request after this step (== n: fresh)
    state_slots,  # i32[R]
    num_seqs,  # i32[1] real requests
    *, num_k_heads: int, layer=0, impl=None,
    block_sizes: gdn.GdnBlockSizes | None = None,
):
    """One GDN layer in verify mode (see the module docstring); the slots are not written.

    Returns o [T, Hv, Dv] in mixed_qkv's dtype, windows [R, K-1+n, C] in conv_state's dtype
    and rec_steps [R, n, Hv, Dk, Dv] in rec_state's dtype (zero for padding requests).
    """
    resolved = dispatch.resolve(impl, has_xla=True)
    _check(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
           state_slots, num_seqs, num_k_heads, layer, block_sizes)
    Lyr, _, Hv, Dk, Dv = rec_state.shape
    layer = gdn._layer_index(layer, Lyr)
    args = (mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
            state_slots, num_seqs)
    if resolved == "reference":
        return ref_gdn_verify(*args, num_k_heads=num_k_heads, layer=layer)
    if resolved == "xla":
        return _xla_verify(*args, num_k_heads, layer)
    K, T, R = conv_weight.shape[1], mixed_qkv.shape[0], kv_lens.shape[0]
    kb = (block_sizes or gdn.GdnBlockSizes()).k_heads_per_block
    if kb is None:
        kb = gdn_kernels.default_k_heads_per_block(num_k_heads, Hv, Dk, Dv)
    geom = gdn_kernels.Geometry(Hk=num_k_heads, Hv=Hv, Dk=Dk, Dv=Dv, K=K, kb=kb, L=T // R)
    n, _, real, fresh = _verify_meta(T, kv_lens, num_seqs)
    cost = gated_delta_net_verify_cost(R, n, num_k_heads, Hv, Dk, Dv, conv_kernel=K,
                                       x_bytes=mixed_qkv.dtype.itemsize,
                                       state_bytes=rec_state.dtype.itemsize)
    o, rec_steps, cs0 = gdn_verify_kernel.pallas_gdn_verify(
        *args[:8], state_slots, real, fresh, layer, geom=geom, cost=cost.to_pallas(),
        interpret=dispatch.interpret_params(resolved))
    win = jnp.where(real[:, None, None], _windows(cs0[:, : K - 1], mixed_qkv, conv_state.dtype, n),
                    0.0)
    return o, win.astype(conv_state.dtype), rec_steps


def gated_delta_net_verify_cost(num_seqs: int, n: int, num_k_heads: int, num_v_heads: int,
                                head_k_dim: int, head_v_dim: int, *, conv_kernel: int = 4,
                                x_bytes: int = 2, state_bytes: int = 4) -> Cost:
    """Analytic cost of one verify call: n decode steps of R requests (``gated_delta_net_cost``
    with decode=True over T = R*n rows, which counts each row's state read and written once),
    corrected to one state read and n state writes per request."""
    R, Hv, Dk, Dv = num_seqs, num_v_heads, head_k_dim, head_v_dim
    steps = gdn.gated_delta_net_cost(R * n, R * n, num_k_heads, Hv, Dk, Dv,
                                     conv_kernel=conv_kernel, decode=True, x_bytes=x_bytes,
                                     state_bytes=state_bytes)
    C = 2 * num_k_heads * Dk + Hv * Dv
    per_state = Hv * Dk * Dv * state_bytes
    extra = R * (n + 1) * per_state - 2 * R * n * per_state  # R reads + R*n writes
    extra -= R * (n - 1) * 2 * C * (conv_kernel - 1) * x_bytes  # conv state: read once
    return Cost(steps.flops, steps.bytes_accessed + extra, steps.transcendentals)


def commit_states(conv_state, rec_state, windows, rec_steps, state_slots, accepted_len):
    """Set each slot to the state after its first ``accepted_len[r]`` verified positions.

    conv_state [Lyr, S, rows, C], rec_state [Lyr, S, Hv, Dk, Dv]; windows [Lyr, R, K-1+n, C]
    and rec_steps [Lyr, R, n, Hv, Dk, Dv] from verify mode of every layer (stacked);
    state_slots, accepted_len i32[R]. ``accepted_len[r]`` = 0 (or a negative value, or a slot
    outside [0, S)) leaves slot r's state as it is; 1..n takes the state after that many
    tokens. One program for every accepted length: a loop over the R requests that copies one
    slot of every layer per iteration in place (a gather of all R states and a scatter would
    hold several R-state temporaries, gigabytes at 397B shapes).
    """
    S, n = rec_state.shape[1], rec_steps.shape[2]
    Lyr, R, _, Hv, Dk, Dv = rec_steps.shape
    K1, C = windows.shape[2] - n, windows.shape[3]
    acc = jnp.clip(accepted_len, 0, n).astype(jnp.int32)
    write = (acc > 0) & (state_slots >= 0) & (state_slots < S)
    slots = jnp.clip(state_slots, 0, S - 1).astype(jnp.int32)

    def one(r, states):
        cs, rs = states
        a, slot, zero = acc[r], slots[r], jnp.int32(0)
        new_rs = lax.dynamic_slice(rec_steps, (zero, r, jnp.maximum(a - 1, 0), zero, zero, zero),
                                   (Lyr, 1, 1, Hv, Dk, Dv))[:, :, 0]
        old_rs = lax.dynamic_slice(rs, (zero, slot, zero, zero, zero), (Lyr, 1, Hv, Dk, Dv))
        new_cs = lax.dynamic_slice(windows, (zero, r, a, zero), (Lyr, 1, K1, C))
        old_cs = lax.dynamic_slice(cs, (zero, slot, zero, zero), (Lyr, 1, K1, C))
        rs = lax.dynamic_update_slice(
            rs, jnp.where(write[r], new_rs.astype(rs.dtype), old_rs), (zero, slot, zero, zero, zero))
        cs = lax.dynamic_update_slice(
            cs, jnp.where(write[r], new_cs.astype(cs.dtype), old_cs), (zero, slot, zero, zero))
        return cs, rs

    return lax.fori_loop(0, R, one, (conv_state, rec_state))
