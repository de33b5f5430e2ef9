"""Math and batch metadata shared by the GDN references (``kernels/gdn.py``) and the Pallas
kernels (``kernels/gdn_kernels.py``). See ``kernels/gdn.py`` for the op, its numerics and the
dimension letters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

L2NORM_EPS = 1e-6  # transformers' l2norm eps for q and k
F32 = jnp.float32
HI = lax.Precision.HIGHEST  # f32 matmuls must not drop to bf16 passes
# Chunk / decode-row flags (scalar-prefetched, one i32 per chunk or decode row).
VALID, FIRST, LAST, FRESH = 1, 2, 4, 8


# ----------------------------------------------------------------------------- math


def conv_state_rows(conv_kernel: int) -> int:
    """Rows of one conv-state slot: the K-1 last inputs, rounded up to a power of two.

    XLA:TPU lays ``[Lyr, S, rows, C]`` out row-major (tiles (rows, 128)) when rows is a power of
    two, which is the layout Mosaic kernels take; for rows = 3 its default layout makes S the
    second-minor dim, and every kernel call would copy the whole stacked state in and out.
    Rows K-1.. are padding: zero, never read. The padded layout costs what row-major tiling of
    3 rows would cost anyway.
    """
    rows = 1
    while rows < conv_kernel - 1:
        rows *= 2
    return rows


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def gates(a, b, A_log, dt_bias):
    """f32 (g, beta) from a, b [..., Hv] and f32 A_log, dt_bias broadcastable to them."""
    beta = sigmoid(b.astype(F32)).astype(b.dtype).astype(F32)
    g = -jnp.exp(A_log.astype(F32)) * softplus(a.astype(F32) + dt_bias.astype(F32))
    return g, beta


def conv_act(taps, w_taps, w_dtype, x_dtype):
    """Depthwise conv + SiLU: sum_j taps[j] * w_taps[j] (oldest tap first), f32 in and out.

    The sum is rounded to the weight dtype before SiLU and to the input dtype after it.
    """
    acc = taps[0] * w_taps[0]
    for tap, w in zip(taps[1:], w_taps[1:]):
        acc = acc + tap * w
    y = acc.astype(w_dtype).astype(F32)
    y = y * sigmoid(y)
    return y.astype(x_dtype).astype(F32)


def l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


# ----------------------------------------------------------------------------- batch metadata


def request_meta(cu_q_lens, kv_lens, num_seqs):
    """i32 q_len[R], bool real[R] (a real request with tokens), bool fresh[R]."""
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    real = (jnp.arange(q_len.shape[0]) < num_seqs[0]) & (q_len > 0)
    return q_len, real, (kv_lens - q_len) <= 0


def token_meta(cu_q_lens, num_seqs, num_tokens):
    """i32 req[T] (owning request, clipped), i32 pos[T] (index inside this step), bool valid[T]."""
    num_reqs = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens)
    req = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_reqs - 1)
    end = cu_q_lens[jnp.clip(num_seqs[0], 0, num_reqs)]
    return req, t - cu_q_lens[req], t < end


def num_chunk_slots(num_tokens: int, num_reqs: int, chunk_size: int) -> int:
    """Static bound on the chunks of a ragged batch: sum_r cdiv(q_len_r, L) <= this."""
    return max(1, min(num_tokens, -(-num_tokens // chunk_size) + num_reqs))


class ChunkLayout(NamedTuple):
    """Chunk n of a ragged batch (chunks in token order; all i32)."""

    req: object  # [N] owning request (clipped)
    start: object  # [N] first token
    length: object  # [N] tokens in the chunk (0: unused chunk slot)
    slot: object  # [N] state slot of the owning request
    flags: object  # [N] VALID | FIRST | LAST | FRESH
    first_chunk: object  # [R] index of each request's first chunk


def chunk_layout(cu_q_lens, kv_lens, state_slots, num_seqs, chunk_size, num_chunks):
    """Cut each real request's tokens into chunks of ``chunk_size`` (see :class:`ChunkLayout`)."""
    num_reqs = cu_q_lens.shape[0] - 1
    q_len, real, fresh = request_meta(cu_q_lens, kv_lens, num_seqs)
    per_req = jnp.where(real, -(-q_len // chunk_size), 0)
    chunk_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_req).astype(jnp.int32)])
    n = jnp.arange(num_chunks)
    req = jnp.clip(jnp.searchsorted(chunk_cu, n, side="right") - 1, 0, num_reqs - 1)
    valid = n < chunk_cu[-1]
    i = n - chunk_cu[req]
    start = jnp.where(valid, cu_q_lens[req] + i * chunk_size, 0)
    length = jnp.where(valid, jnp.clip(q_len[req] - i * chunk_size, 0, chunk_size), 0)
    flags = (
        valid * VALID
        + (valid & (i == 0)) * FIRST
        + (valid & (i == per_req[req] - 1)) * LAST
        + (valid & fresh[req]) * FRESH
    )
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return ChunkLayout(i32(req), i32(start), i32(length), i32(state_slots[req]), i32(flags),
                       chunk_cu[:-1])


def decode_rows(kv_lens, state_slots, num_seqs, num_rows):
    """Per decode row: slot, kv_len, real flag (row < R and row < num_seqs)."""
    R = state_slots.shape[0]
    rows = jnp.arange(num_rows)
    ridx = jnp.clip(rows, 0, R - 1)
    real = (rows < R) & (rows < num_seqs[0])
    return state_slots[ridx], kv_lens[ridx], real
