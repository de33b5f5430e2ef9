"""Shared by every path of ragged paged attention: the masked-score value, the per-token
metadata, the layer index and input validation (dimension letters: see the package docstring).
"""

from __future__ import annotations

import jax.numpy as jnp

# Finite "minus infinity" for masked scores: exp(MASK_VALUE - m) == 0 without inf - inf NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens):
    """Per token: request row, absolute KV position, and whether it is a real token.

    Returns (i32[T], i32[T], bool[T]). Rows past num_seqs count as empty requests.
    """
    num_rows = kv_lens.shape[0]
    ns = jnp.clip(num_seqs[0], 0, num_rows)
    cu = jnp.where(jnp.arange(num_rows + 1) <= ns, cu_q_lens, cu_q_lens[ns])  # i32[R+1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # i32[T]
    req = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, num_rows - 1).astype(jnp.int32)
    valid = (t >= cu[0]) & (t < cu[num_rows])
    q_len = cu[req + 1] - cu[req]
    pos = kv_lens[req] - q_len + (t - cu[req])  # i32[T]
    return req, pos.astype(jnp.int32), valid


def _layer_index(layer, num_layers):
    """``layer`` as an i32 scalar; a traced one is clipped into [0, Lyr) (static ones are
    range-checked by :func:`_validate`)."""
    return jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)


def _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer,
              kv_scales=None):
    def bad(msg):
        shapes = (f"q {q.shape}, kv_pages {kv_pages.shape}, kv_lens {kv_lens.shape}, "
                  f"page_indices {page_indices.shape}, cu_q_lens {cu_q_lens.shape}, num_seqs "
                  f"{num_seqs.shape}")
        raise ValueError(f"ragged_paged_attention: {msg} ({shapes})")

    if q.ndim != 3:
        bad("q must be [T, Hq, D]")
    if kv_pages.ndim != 5 or kv_pages.shape[2] % 2 != 0 or kv_pages.shape[0] < 1:
        bad("kv_pages must be [layers, num_pages, 2 * Hkv, page_size, D]")
    num_kv_heads = kv_pages.shape[2] // 2
    if kv_pages.shape[4] != q.shape[2]:
        bad("head_dim of q and kv_pages differ")
    if q.shape[1] % num_kv_heads != 0:
        bad("num q heads must be a multiple of num kv heads")
    if kv_lens.ndim != 1 or page_indices.ndim != 2 or page_indices.shape[0] != kv_lens.shape[0]:
        bad("kv_lens must be [R] and page_indices [R, pages_per_seq]")
    if kv_lens.shape[0] < 1 or page_indices.shape[1] < 1:
        bad("need at least one request row and one page per row")
    if cu_q_lens.shape != (kv_lens.shape[0] + 1,):
        bad("cu_q_lens must be [R + 1]")
    if num_seqs.shape != (1,):
        bad("num_seqs must be [1]")
    for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            bad(f"{name} must be an integer array, got {a.dtype}")
    if (new_k is None) != (new_v is None):
        bad("give both new_k and new_v or neither")
    if new_k is not None:
        want = (q.shape[0], num_kv_heads, kv_pages.shape[4])
        if new_k.shape != want or new_v.shape != want:
            bad(f"new_k/new_v must be [T, Hkv, D] = {want}, got {new_k.shape}/{new_v.shape}")
    if kv_scales is not None and (kv_scales.shape != kv_pages.shape[:4]
                                  or kv_scales.dtype != jnp.float32):
        bad(f"kv_scales must be f32[layers, num_pages, 2 * Hkv, page_size] = f32"
            f"{list(kv_pages.shape[:4])}, got {kv_scales.dtype}{list(kv_scales.shape)}")
    if isinstance(layer, int):
        if not 0 <= layer < kv_pages.shape[0]:
            bad(f"layer {layer} out of range for {kv_pages.shape[0]} layers")
    elif jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        bad(f"layer must be an int or an integer scalar, got {layer!r}")
