"""Verify mode of the fused conv1d + Gated DeltaNet (k+1 tokens per request) and its commit.

Speculative decoding verifies a request's last token and its k drafts (n = k+1 positions) in
one step, and only afterwards knows how many of them to keep. :func:`gated_delta_net_verify`
runs one GDN layer over such a batch from each request's state slot *without writing the
slot*, and returns o and what is needed to redo any accepted prefix a in 0..n later:

  * ``windows [R, K-1+n, C]`` (conv_state's dtype): the conv window of the slot (K-1 rows,
    oldest first; zeros for a fresh request) followed by the request's n pre-conv inputs.
    The conv state after a tokens is ``windows[r, a : a+K-1]``.
  * ``a, b [R, n, Hv]`` (their dtype): each position's gate inputs.

No per-position recurrent state is kept: at the 397B model's shapes that is n x 2 MiB per
request and GDN layer (bf16), gigabytes per device. :func:`commit_states` instead runs the
accepted positions of the recurrence again, from the slot, for every GDN layer, and writes
the result into the slot: one state read and write per request and layer, and the FLOPs of
a <= n decode steps of the GDN layers only (the model is not re-run).

Layout: T = R * n tokens, request r owns rows ``r*n .. r*n+n-1`` (every request, padding
requests included, has exactly n rows; n is static, ``T // R``). Requests ``r >= num_seqs``
are padding: their outputs are zero. A request with ``kv_lens[r] == n`` is fresh (its slot
is read as zeros), as in ``kernels/gdn.py``. Dimension letters and numerics as there.

Each position, in verify mode and in the commit, is one decode step in the decode path's
association order (``gdn._decode_step``: o = q.S_pre + (q.k) d). On the XLA path all run the
same loop body (``gdn.decode_loop``) and on the Pallas path the decode kernel's per-step code,
so in float32 the state the commit leaves after a positions equals bit for bit what a decode
steps of ``gated_delta_net(decode=True)`` on the same implementation leave in the slot. That
needs the conv state's dtype to hold mixed_qkv's values exactly (the same dtype or a wider
one): the commit reads the inputs back from the windows, cast to a's dtype. The reference
agrees with both to rounding (another association order).

Implementations (``impl``, ``kernels/dispatch.py``):
  * ``"xla"`` / ``"auto"`` off-TPU: n decode steps over all requests (``gdn.decode_loop``).
  * ``"reference"``: the ground truth, :func:`gdn.ref_recurrent_gdn` (transformers' order):
    over all n tokens of every request (verify), over each request's accepted ones (commit).
  * ``"pallas"`` / ``"interpret"``: ``gdn_verify_kernel``, one grid step per (head block,
    request) that reads the slot once and runs the n positions in VMEM.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import dispatch, gdn, gdn_kernels, gdn_verify_kernel
from .cost import Cost
from .gdn_common import F32, token_meta

__all__ = ["commit_states", "gated_delta_net_commit_cost", "gated_delta_net_verify",
           "gated_delta_net_verify_cost", "ref_gdn_verify"]


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


def _gate_inputs(a, b, real, n):
    """a, b [R*n, Hv] -> [R, n, Hv] each, zero for padding requests."""
    R = real.shape[0]
    keep = lambda z: jnp.where(real[:, None, None], z.reshape(R, n, -1), 0)  # noqa: E731
    return keep(a).astype(a.dtype), keep(b).astype(b.dtype)


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
    o, _, _ = gdn.decode_loop(win[:, : K - 1], s0, by_position(mixed_qkv), by_position(a),
                              by_position(b), conv_weight, A_log, dt_bias, num_k_heads,
                              once, rec_state.dtype, conv_state.dtype)
    o = jnp.where(real[:, None, None, None], jnp.moveaxis(o, 0, 1), 0.0)
    win = jnp.where(real[:, None, None], win, 0.0)
    return (o.reshape(T, Hv, Dv).astype(mixed_qkv.dtype), win.astype(conv_state.dtype),
            *_gate_inputs(a, b, real, n))


def ref_gdn_verify(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state,
                   kv_lens, state_slots, num_seqs, *, num_k_heads: int, layer=0):
    """Ground truth of :func:`gated_delta_net_verify`: :func:`gdn.ref_recurrent_gdn` over the
    n tokens of every request, its slot writes dropped. Same arguments and results."""
    _check(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, rec_state, kv_lens,
           state_slots, num_seqs, num_k_heads, layer)
    T = mixed_qkv.shape[0]
    K = conv_weight.shape[1]
    n, cu, real, fresh = _verify_meta(T, kv_lens, num_seqs)
    layer = gdn._layer_index(layer, rec_state.shape[0])
    o, _, _ = gdn.ref_recurrent_gdn(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state,
                                    rec_state, cu, kv_lens, state_slots, num_seqs,
                                    num_k_heads=num_k_heads, layer=layer)
    win = _windows(_slot_windows(conv_state, layer, state_slots, fresh, K), mixed_qkv,
                   conv_state.dtype, n)
    win = jnp.where(real[:, None, None], win, 0.0)
    return (o, win.astype(conv_state.dtype), *_gate_inputs(a, b, real, n))


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
    and a, b [R, n, Hv] in their dtype (zero for padding requests).
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
    geom = _geometry(num_k_heads, Hv, Dk, Dv, K, T // R, block_sizes)
    n, _, real, fresh = _verify_meta(T, kv_lens, num_seqs)
    cost = gated_delta_net_verify_cost(R, n, num_k_heads, Hv, Dk, Dv, conv_kernel=K,
                                       x_bytes=mixed_qkv.dtype.itemsize,
                                       state_bytes=rec_state.dtype.itemsize)
    o, cs0 = gdn_verify_kernel.pallas_gdn_verify(
        *args[:8], state_slots, real, fresh, layer, geom=geom, cost=cost.to_pallas(),
        interpret=dispatch.interpret_params(resolved))
    win = jnp.where(real[:, None, None], _windows(cs0[:, : K - 1], mixed_qkv, conv_state.dtype, n),
                    0.0)
    return (o, win.astype(conv_state.dtype), *_gate_inputs(a, b, real, n))


def _geometry(num_k_heads, Hv, Dk, Dv, K, n, block_sizes):
    kb = (block_sizes or gdn.GdnBlockSizes()).k_heads_per_block
    if kb is None:
        kb = gdn_kernels.default_k_heads_per_block(num_k_heads, Hv, Dk, Dv)
    return gdn_kernels.Geometry(Hk=num_k_heads, Hv=Hv, Dk=Dk, Dv=Dv, K=K, kb=kb, L=n)


def gated_delta_net_verify_cost(num_seqs: int, n: int, num_k_heads: int, num_v_heads: int,
                                head_k_dim: int, head_v_dim: int, *, conv_kernel: int = 4,
                                x_bytes: int = 2, state_bytes: int = 4) -> Cost:
    """Analytic cost of one verify call: n decode steps of R requests (``gated_delta_net_cost``
    with decode=True over T = R*n rows, which counts each row's state read and written once),
    corrected to one state read per request and no state write (the conv state read once and
    the window written once per request)."""
    R, Hv, Dk, Dv = num_seqs, num_v_heads, head_k_dim, head_v_dim
    steps = gdn.gated_delta_net_cost(R * n, R * n, num_k_heads, Hv, Dk, Dv,
                                     conv_kernel=conv_kernel, decode=True, x_bytes=x_bytes,
                                     state_bytes=state_bytes)
    C = 2 * num_k_heads * Dk + Hv * Dv
    per_state = Hv * Dk * Dv * state_bytes
    extra = R * per_state - 2 * R * n * per_state  # R reads, no writes
    extra -= R * (n - 1) * 2 * C * (conv_kernel - 1) * x_bytes  # conv state: read once
    return Cost(steps.flops, steps.bytes_accessed + extra, steps.transcendentals)


def gated_delta_net_commit_cost(num_seqs: int, n: int, num_k_heads: int, num_v_heads: int,
                                head_k_dim: int, head_v_dim: int, *, conv_kernel: int = 4,
                                x_bytes: int = 2, state_bytes: int = 4) -> Cost:
    """Analytic cost of one layer of :func:`commit_states` with all n positions accepted (its
    most): the FLOPs of n decode steps of R requests, one recurrent state read and written
    per request, the windows [R, K-1+n, C] and a, b [R, n, Hv] read, the conv state written."""
    R, Hv, Dk, Dv, K = num_seqs, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    steps = gdn.gated_delta_net_cost(R * n, R * n, num_k_heads, Hv, Dk, Dv, conv_kernel=K,
                                     decode=True, x_bytes=x_bytes, state_bytes=state_bytes)
    C = 2 * num_k_heads * Dk + Hv * Dv
    per_req = (2 * Hv * Dk * Dv * state_bytes + (2 * (K - 1) + n) * C * x_bytes
               + 2 * n * Hv * x_bytes)
    return Cost(steps.flops, R * per_req + C * K * x_bytes + 8 * Hv, steps.transcendentals)


def _xla_commit_layer(cs, rs, win, a, b, w, A_log, dt_bias, layer, slots, acc, fresh, once, *,
                      num_k_heads, **_):
    """The accepted positions as decode steps (``gdn.decode_loop``), then a scatter of the
    written slots' states (acc > 0)."""
    K1, n = w.shape[1] - 1, a.shape[1]
    s0 = jnp.where(fresh[:, None, None, None], 0.0, rs[layer, slots].astype(F32))
    by_position = lambda z: jnp.moveaxis(z, 1, 0)  # noqa: E731 [R, n, *] -> [n, R, *]
    live = jnp.arange(n)[:, None] < acc[None, :]  # bool[n, R]
    x = by_position(win[:, K1:].astype(a.dtype))  # exact: the inputs were a's dtype
    _, s, last = gdn.decode_loop(win[:, :K1].astype(F32), s0, x, by_position(a), by_position(b),
                                 w, A_log, dt_bias, num_k_heads, once, rs.dtype, cs.dtype,
                                 live=live)
    return gdn._store_states(cs, rs, layer, slots, acc > 0, last, s)


def _ref_commit_layer(cs, rs, win, a, b, w, A_log, dt_bias, layer, slots, acc, fresh, once, *,
                      num_k_heads, **_):
    """:func:`gdn.ref_recurrent_gdn` over each request's accepted tokens (packed ragged)."""
    R, n = a.shape[:2]
    K1 = w.shape[1] - 1
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(acc).astype(jnp.int32)])
    all_reqs = jnp.full((1,), R, jnp.int32)
    req, pos, _ = token_meta(cu, all_reqs, R * n)
    pick = lambda z: z[req, jnp.clip(pos, 0, n - 1)]  # noqa: E731 [R, n, *] -> [R*n, *]
    kv_lens = jnp.where(fresh, acc, acc + 1)  # fresh: kv_len == q_len (zero state)
    _, cs, rs = gdn.ref_recurrent_gdn(pick(win[:, K1:].astype(a.dtype)), pick(a), pick(b), w,
                                      A_log, dt_bias, cs, rs, cu, kv_lens, slots, all_reqs,
                                      num_k_heads=num_k_heads, layer=layer)
    return cs, rs


def _pallas_commit_layer(cs, rs, win, a, b, w, A_log, dt_bias, layer, slots, acc, fresh, once,
                         *, num_k_heads, resolved, block_sizes):
    R, n = a.shape[:2]
    _, _, Hv, Dk, Dv = rs.shape
    K = w.shape[1]
    geom = _geometry(num_k_heads, Hv, Dk, Dv, K, n, block_sizes)
    cost = gated_delta_net_commit_cost(R, n, num_k_heads, Hv, Dk, Dv, conv_kernel=K,
                                       x_bytes=cs.dtype.itemsize, state_bytes=rs.dtype.itemsize)
    return gdn_verify_kernel.pallas_gdn_commit(
        cs, rs, win, a, b, w, A_log, dt_bias, slots, acc, fresh, layer, geom=geom,
        x_dtype=a.dtype, cost=cost.to_pallas(), interpret=dispatch.interpret_params(resolved))


def commit_states(
    conv_state,  # [Lyr, S, rows, C]
    rec_state,  # [Lyr, S, Hv, Dk, Dv]
    windows,  # [Lyr, R, K-1+n, C] verify mode's windows of every GDN layer (stacked)
    a, b,  # [Lyr, R, n, Hv] verify mode's gate inputs of every GDN layer (stacked)
    fresh,  # bool[R] the request started from zeros (kv_lens <= n in the verify step)
    conv_weight,  # [Lyr, C, K] every GDN layer's conv weights
    A_log, dt_bias,  # f32[Lyr, Hv]
    state_slots,  # i32[R]
    accepted_len,  # i32[R]
    *, num_k_heads: int, impl=None, block_sizes: gdn.GdnBlockSizes | None = None,
):
    """Set each slot to the state after its first ``accepted_len[r]`` verified positions.

    For every GDN layer (a loop: one layer's temporaries at a time), runs positions
    j < accepted_len[r] of the recurrence again from the slot's state and the window's first
    K-1 rows, and writes the final state and conv window ``windows[r, a : a+K-1]`` into the
    slot. ``accepted_len[r]`` = 0 (or a negative value, or a slot outside [0, S)) leaves slot
    r as it is; values above n count as n. One program for every accepted length. Returns
    (conv_state, rec_state), updated in place where the caller donates them.
    """
    resolved = dispatch.resolve(impl, has_xla=True)
    Lyr, S = rec_state.shape[:2]
    _, R, n, Hv = a.shape
    K = conv_weight.shape[-1]
    want = {"windows": (Lyr, R, K - 1 + n, conv_state.shape[-1]), "b": (Lyr, R, n, Hv),
            "fresh": (R,), "conv_weight": (Lyr, conv_state.shape[-1], K), "A_log": (Lyr, Hv),
            "dt_bias": (Lyr, Hv), "state_slots": (R,), "accepted_len": (R,)}
    got = dict(windows=windows, b=b, fresh=fresh, conv_weight=conv_weight, A_log=A_log,
               dt_bias=dt_bias, state_slots=state_slots, accepted_len=accepted_len)
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"commit_states: {name} must be {shape} (a {a.shape}, rec_state "
                             f"{rec_state.shape}), got {tuple(got[name].shape)}")
    acc = jnp.clip(accepted_len, 0, n).astype(jnp.int32)
    acc = jnp.where((state_slots >= 0) & (state_slots < S), acc, 0)
    slots = jnp.clip(state_slots, 0, S - 1).astype(jnp.int32)
    # 1, read from an input so that XLA cannot inline decode_loop's one-step loops.
    once = jnp.where(accepted_len[0] >= jnp.iinfo(jnp.int32).min, 1, 0)
    layer_fn = {"reference": _ref_commit_layer, "xla": _xla_commit_layer}.get(
        resolved, _pallas_commit_layer)

    def one_layer(layer, states):
        return layer_fn(*states, windows[layer], a[layer], b[layer], conv_weight[layer],
                        A_log[layer], dt_bias[layer], layer, slots, acc, fresh, once,
                        num_k_heads=num_k_heads, resolved=resolved, block_sizes=block_sizes)

    return lax.fori_loop(0, Lyr, one_layer, (conv_state, rec_state))
