"""Pure-JAX reference of ragged paged attention: the slow, obvious oracle of every path.

Dimension letters and the metadata contract: see the package docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .common import MASK_VALUE, _layer_index, _token_metadata, _validate
from .kv_write import _outputs, _write

# Memory budget of one lax.map batch of the reference (gathered K/V in fp32 plus scores).
REF_BATCH_BYTES = 128 * 1024 * 1024


def _ref_attention(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                   kv_scales=None):
    """q [T, Hq, D] -> o [T, Hq, D] in q.dtype; layer an i32 scalar. Each token gathers all its
    request's pages ``[P, 2*Hkv, S, D]`` of that layer (times their scales f32[P, 2*Hkv, S]
    when kv_scales is given) and attends to them in fp32."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, two_hkv, page_size, _ = kv_pages.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    max_kv = pages_per_seq * page_size
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)

    def one_token(args):
        q_t, r, p, ok = args  # [Hq, D], i32, i32, bool
        pages = page_indices[r]  # i32[P]
        kv = kv_pages.at[layer, pages].get(mode="clip").astype(jnp.float32)  # [P, 2*Hkv, S, D]
        if kv_scales is not None:
            kv = kv * kv_scales.at[layer, pages].get(mode="clip")[..., None]
        kv = kv.reshape(pages_per_seq, num_kv_heads, 2, page_size, head_dim)
        kv = kv.transpose(2, 1, 0, 3, 4).reshape(2, num_kv_heads, max_kv, head_dim)
        k, v = kv[0], kv[1]  # f32[Hkv, P*S, D]
        qg = q_t.reshape(num_kv_heads, group, head_dim).astype(jnp.float32)  # f32[Hkv, G, D]
        s = jnp.einsum("hgd,hsd->hgs", qg, k,
                       precision=lax.Precision.HIGHEST) * sm_scale  # f32[Hkv, G, P*S]
        s = jnp.where(jnp.arange(max_kv) <= p, s, MASK_VALUE)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("hgs,hsd->hgd", w, v, precision=lax.Precision.HIGHEST)  # f32[Hkv, G, D]
        o = jnp.where(ok, o, 0.0)
        return o.reshape(num_q_heads, head_dim).astype(q.dtype)

    per_token = 2 * max_kv * num_kv_heads * head_dim * 4 + 2 * num_q_heads * max_kv * 4
    batch = int(max(1, min(num_tokens, REF_BATCH_BYTES // per_token)))
    return lax.map(one_token, (q, req, pos, valid), batch_size=batch)


def ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale: float, new_k=None, new_v=None, layer=0,
                               kv_scales=None):
    """Pure-JAX reference; same contract as :func:`ragged_paged_attention`.

    Gathers each token's request pages of layer ``layer`` in ``lax.map`` batches sized to
    ~REF_BATCH_BYTES and masks causally; never materialises a [T, R, ...] array.
    """
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer,
              kv_scales)
    if new_k is not None:
        kv_pages, kv_scales = _write(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, layer, kv_scales)
    o = _ref_attention(q, kv_pages, _layer_index(layer, kv_pages.shape[0]), kv_lens,
                       page_indices, cu_q_lens, num_seqs, sm_scale, kv_scales)
    return _outputs(o, kv_pages, kv_scales, new_k is not None)
