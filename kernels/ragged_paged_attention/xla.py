"""The XLA path of ragged paged attention (``impl="xla"``, what ``"auto"`` picks off TPU).

Online softmax over blocks of pages in plain XLA: only the pages the step's requests hold are
read, not the page table's width. Dimension letters: see the package docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .common import MASK_VALUE, _layer_index, _token_metadata, _validate
from .kv_write import _outputs, _write, new_kv_rows
from .quant import dequantize

# KV tokens per block of the XLA path: small, so a short context reads little past its end.
# Every row of a step reads as many blocks as the step's longest request, and XLA scores
# every key of a block, masked or not, so with large blocks a decode step of short contexts
# would mostly score masked keys.
XLA_KV_BLOCK_TOKENS = 128
PREFIX_GROUP = 16  # tokens per group of the prefix pass (the tokens that have cached keys)


def _softmax_init(rows: int, num_kv_heads: int, group: int, head_dim: int):
    """Empty online-softmax state: running max, sum f32[rows, Hkv, G] and acc [.., D]."""
    shape = (rows, num_kv_heads, group)
    return (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _paged_softmax(qg, kv_pages, layer, tok_pages, limit, num_blocks, bp, kv_scales=None):
    """Online softmax of each row over the keys its pages hold below ``limit``.

    qg f32[N, Hkv, G, D] scaled queries; tok_pages i32[N, W] each row's page ids (W a multiple
    of ``bp``); limit i32[N]: keys at positions < limit[n] are visible; ``num_blocks``
    (traced) blocks of ``bp`` pages are read, each row gathering its pages
    ``[N, Bp, 2*Hkv, S, D]`` (times their scales f32[N, Bp, 2*Hkv, S] when kv_scales is
    given). Returns the (max, sum, acc) state of :func:`_softmax_init`.
    """
    n, num_kv_heads, group, head_dim = qg.shape
    page_size = kv_pages.shape[3]
    block_pos = jnp.arange(bp * page_size, dtype=jnp.int32)  # i32[Bp*S]

    def block(j, carry):
        m, l, acc = carry  # f32[N, Hkv, G], f32[N, Hkv, G], f32[N, Hkv, G, D]
        pages = lax.dynamic_slice_in_dim(tok_pages, j * bp, bp, axis=1)  # i32[N, Bp]
        kv = kv_pages.at[layer, pages].get(mode="clip").astype(jnp.float32)  # [N,Bp,2Hkv,S,D]
        if kv_scales is not None:
            kv = kv * kv_scales.at[layer, pages].get(mode="clip")[..., None]
        kv = kv.reshape(n, bp, num_kv_heads, 2, page_size, head_dim)
        kv = kv.transpose(3, 0, 2, 1, 4, 5).reshape(2, n, num_kv_heads, bp * page_size, head_dim)
        k, v = kv[0], kv[1]  # f32[N, Hkv, Bp*S, D]
        s = jnp.einsum("thgd,thsd->thgs", qg, k, precision=lax.Precision.HIGHEST)
        visible = (j * bp * page_size + block_pos)[None, :] < limit[:, None]  # bool[N, Bp*S]
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)  # f32[N, Hkv, G, Bp*S]
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + p.sum(axis=-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("thgs,thsd->thgd", p, v,
                                                      precision=lax.Precision.HIGHEST)
        return m_new, l_new, acc_new

    return lax.fori_loop(0, num_blocks, block, _softmax_init(n, num_kv_heads, group, head_dim))


def _padded_table(page_indices, bp):
    """page_indices i32[R, P] padded with zeros to a multiple of ``bp`` pages."""
    pages_per_seq = page_indices.shape[1]
    width = -(-pages_per_seq // bp) * bp
    return jnp.pad(page_indices, ((0, 0), (0, width - pages_per_seq)))


def _xla_attention(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                   pages_per_block, kv_scales=None):
    """Online-softmax attention over blocks of ``pages_per_block`` pages, for CPU/GPU serving.

    The loop runs ``cdiv(longest real request's pages, pages_per_block)`` times (a traced trip
    count, no recompile): a step reads the pages its requests hold, not the page table's width.
    Per block each token gathers its request's pages ``[T, Bp, 2*Hkv, S, D]`` and updates a
    running max / sum / accumulator in fp32 (the Pallas kernel's recurrence).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[2] // 2
    group = num_q_heads // num_kv_heads
    num_rows, pages_per_seq = page_indices.shape
    bp = min(pages_per_block, pages_per_seq)
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)
    real = jnp.arange(num_rows) < jnp.clip(num_seqs[0], 0, num_rows)
    longest = jnp.max(jnp.where(real, kv_lens, 0))
    num_blocks = -(-longest // (bp * kv_pages.shape[3]))  # traced
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    # qg f32[T, Hkv, G, D]; l f32[T, Hkv, G], acc f32[T, Hkv, G, D]
    _, l, acc = _paged_softmax(qg, kv_pages, layer, _padded_table(page_indices, bp)[req],
                               pos + 1, num_blocks, bp, kv_scales)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _xla_attention_split(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs,
                         sm_scale, pages_per_block, new_k, new_v, kv_scales=None):
    """Attention as two online-softmax passes merged per token (prefill-heavy steps).

    Keys written in this step (the request's own new tokens) are read densely from
    ``new_k`` / ``new_v``: scores ``[T, Hkv, G, T]`` masked to the same request and earlier
    rows, no page gather. Keys already cached before the step (the request's prefix) are read
    from the pages by :func:`_paged_softmax`, but only for the tokens whose request has a
    prefix: they are compacted and processed ``PREFIX_GROUP`` at a time, a traced number of
    groups, so a step of fresh prompts gathers no pages at all, and a prefill chunk's tokens
    do not each gather the pages their own step just wrote.

    The in-step sums run in step coordinates, so a token's rounding can depend on where its
    request sits in the step: batch-invariant serving uses :func:`_xla_attention`.
    """
    T, Hq, D = q.shape
    Hkv = kv_pages.shape[2] // 2
    group = Hq // Hkv
    bp = min(pages_per_block, page_indices.shape[1])
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, T)
    t_idx = jnp.arange(T, dtype=jnp.int32)
    step_start = pos - (t_idx - cu_q_lens[req])  # position of the request's first new token
    qg = q.reshape(T, Hkv, group, D).astype(jnp.float32) * sm_scale  # f32[T, Hkv, G, D]

    # In-step keys: dense scores, same request and not later.
    cached, scales = new_kv_rows(new_k, new_v, kv_pages, kv_scales)  # [T, 2*Hkv, D] as cached
    cached = cached.astype(jnp.float32) if scales is None else dequantize(cached, scales)
    cached = cached.reshape(T, Hkv, 2, D)
    kn, vn = cached[:, :, 0], cached[:, :, 1]  # f32[T, Hkv, D]
    s = jnp.einsum("thgd,shd->thgs", qg, kn, precision=lax.Precision.HIGHEST)  # [T,Hkv,G,T]
    # see bool[T, T]: query t sees the in-step key of token s
    see = (req[:, None] == req[None, :]) & (t_idx[None, :] <= t_idx[:, None]) & valid[None, :]
    s = jnp.where(see[:, None, None, :], s, MASK_VALUE)
    m_b = s.max(-1)  # f32[T, Hkv, G]
    p = jnp.exp(s - m_b[..., None])
    l_b = p.sum(-1)  # f32[T, Hkv, G]
    acc_b = jnp.einsum("thgs,shd->thgd", p, vn, precision=lax.Precision.HIGHEST)  # f32[T,Hkv,G,D]

    # Cached keys (positions < step_start), for the compacted tokens that have any.
    needs = valid & (step_start > 0)  # bool[T]
    # order i32[T + PREFIX_GROUP]: the tokens that need the pass first
    order = jnp.pad(jnp.argsort(~needs, stable=True).astype(jnp.int32), (0, PREFIX_GROUP))
    n_need = jnp.sum(needs)
    size = min(PREFIX_GROUP, T)
    table = _padded_table(page_indices, bp)

    def prefix_group(gi, out):
        rows = lax.dynamic_slice_in_dim(order, gi * size, size)  # i32[size], needing first
        live = (gi * size + jnp.arange(size)) < n_need
        limit = jnp.where(live, step_start[rows], 0)  # keys < limit are cached
        num_blocks = -(-jnp.max(limit) // (bp * kv_pages.shape[3]))
        m, l, acc = _paged_softmax(qg[rows], kv_pages, layer, table[req[rows]], limit,
                                   num_blocks, bp, kv_scales)
        dest = jnp.where(live, rows, T)  # dead slots write nowhere
        om, ol, oacc = out
        return (om.at[dest].set(m, mode="drop"), ol.at[dest].set(l, mode="drop"),
                oacc.at[dest].set(acc, mode="drop"))

    m_a, l_a, acc_a = lax.fori_loop(0, -(-n_need // size), prefix_group,
                                    _softmax_init(T, Hkv, group, D))

    m = jnp.maximum(m_a, m_b)
    wa, wb = jnp.exp(m_a - m), jnp.exp(m_b - m)
    l = wa * l_a + wb * l_b
    acc = wa[..., None] * acc_a + wb[..., None] * acc_b
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    return o.reshape(T, Hq, D).astype(q.dtype)


def _split_miscomputes(kv_scales) -> bool:
    """True where the split form is known to be wrong: an FP8 cache on XLA:TPU. Measured on a
    v5e (JAX 0.10.2): the split form's outputs were up to 13.4 off the reference for the rows
    of requests with several new tokens, while the all-from-pages form on the same pages and
    the split form on the dequantised f32 pages were right (5e-5); the in-step FP8 round trip
    (quantise, dequantise inside one fusion) is the suspect. Off TPU (the path's purpose) the
    split form is exact. On a TPU ``auto`` is the Pallas kernel; this guards ``impl="xla"``."""
    return kv_scales is not None and jax.default_backend() == "tpu"


def xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, new_k=None, new_v=None, layer=0,
                               pages_per_block: int | None = None, batch_invariant: bool = False,
                               kv_scales=None):
    """The serving path off TPU; same contract as :func:`ragged_paged_attention`.

    With new K/V (a serving step) it is :func:`_xla_attention_split`, unless
    ``batch_invariant``: then every token reads its keys from the pages in blocks of absolute
    positions (:func:`_xla_attention`), so its result does not depend on where in the step
    its request sits. ``pages_per_block`` defaults to ``XLA_KV_BLOCK_TOKENS // S`` (at
    least 1)."""
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer,
              kv_scales)
    if new_k is not None:
        kv_pages, kv_scales = _write(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, layer, kv_scales)
    bp = pages_per_block or max(1, XLA_KV_BLOCK_TOKENS // kv_pages.shape[3])
    lyr = _layer_index(layer, kv_pages.shape[0])
    if new_k is not None and not batch_invariant and not _split_miscomputes(kv_scales):
        o = _xla_attention_split(q, kv_pages, lyr, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sm_scale, bp, new_k, new_v, kv_scales)
    else:
        o = _xla_attention(q, kv_pages, lyr, kv_lens, page_indices, cu_q_lens, num_seqs,
                           sm_scale, bp, kv_scales)
    return _outputs(o, kv_pages, kv_scales, new_k is not None)
