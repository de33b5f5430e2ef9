"""Batched ragged paged attention: decode rows and prefill chunks of many requests in one call.

Dimension letters: T tokens of the step (all requests, request after request), R request rows,
Hq query heads, Hkv kv heads, G = Hq // Hkv query heads per kv head, D head dim,
Lyr attention layers sharing the cache, N pages per layer, S page size (tokens per page),
P pages per request row.

KV cache layout: ``kv_pages [Lyr, N, 2 * Hkv, S, D]``; layer l, page n; K of kv head h at index
``2 * h`` and V of kv head h at ``2 * h + 1``. The tiled (minor) dims of the array are (S, D),
so one page ``kv_pages[l, n]`` is a contiguous ``[2 * Hkv, S, D]`` block that the kernel DMAs
whole, and every dynamic index (layer, page) lands on an untiled leading dim.

Request r owns q rows ``cu_q_lens[r]:cu_q_lens[r+1]`` (q_len of them); after this step its KV
holds ``kv_lens[r]`` tokens, so its new tokens sit at positions ``kv_lens[r] - q_len + i`` and
query i attends causally to positions ``0 .. kv_lens[r] - q_len + i``. Position p lives in page
``page_indices[r, p // S]`` at offset ``p % S``. Rows ``r >= num_seqs[0]`` and tokens
``t >= cu_q_lens[num_seqs[0]]`` are padding: their outputs are zero and they write no KV.

New K/V (``new_k``/``new_v``) are written into layer ``layer`` *before* attention: by an XLA
scatter (:func:`write_new_kv`, the reference) or, on the Pallas path, by a second Pallas kernel
(:func:`_pallas_write_new_kv`, bit-identical) that DMAs only the touched W-row windows of the
cache, in place (input_output_aliases). XLA's scatter wants another HBM tiling of the cache
than Mosaic's, so inside the model's layer scan it relaid out the whole stacked cache twice
per layer; with the Pallas write XLA never touches the cache.

Pallas kernel layout (TPU):
  * grid: one step per work item = (request, q block); the wrapper lists the items of the real
    requests in order (at most ``R + cdiv(T, prefill_q_tokens)`` of them) and the trailing grid
    steps are idle. Requests with ``q_len <= decode_q_tokens`` get one small block (a decode
    row: ``decode_q_tokens * G`` score rows), longer ones blocks of ``prefill_q_tokens``.
  * scalar prefetch (SMEM): the layer index, the metadata and the work-item list.
  * q and o stay in HBM (``pl.ANY``) laid out ``[T, Hkv, G, D]`` by the wrapper; each item DMAs
    exactly its own q rows (one ``[Hkv, G, D]`` row per token, indexed on the leading T dim)
    into a double-buffered VMEM tile (the next item's rows are fetched while this one
    computes) and DMAs exactly its own output rows back, so items never write rows of other
    requests and the output needs no padding (it aliases a zero buffer, so padding tokens
    read zero).
  * K/V pages stay in HBM; blocks of ``kv_pages_per_block`` pages are DMA'd one whole page per
    DMA (``kv_hbm.at[layer, page]``) into a double-buffered VMEM scratch
    ``[2, pages_per_block, 2 * Hkv, S, D]``; the first block of the next item is prefetched
    during the last block of the current one. Only pages up to the causal bound of the
    block's last query are fetched.
  * online softmax per kv head over ``[q_tokens * G, D]`` query rows (the G query heads of a
    kv head stacked token-major), running max / sum / accumulator in fp32 VMEM scratch.
  * both grid steps and the KV loop are sequential ("arbitrary"): the cross-item prefetch
    carries a buffer slot from one step to the next.
Mosaic constraints this layout meets: only the last two dims of a buffer are tiled, and every
dynamic DMA offset (layer, page, token row, buffer slot, page within block) is on a leading
dim. In-kernel value reshapes only merge/split a leading dim with the second-minor dim:
``[pages, S, D] -> [pages * S, D]`` (layout-free: S in {16, 256} is a multiple of the sublane
tile) and ``[q_tokens, G, D] <-> [q_tokens * G, D]`` (layout-free for G = 16, the production
ratio; Mosaic relayouts other G: checked to compile for G in {1, 2, 3, 4, 6, 8, 12, 16}, bf16
and f32, D 64 and 128).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import dispatch
from kernels.cost import Cost

# Finite "minus infinity" for masked scores: exp(MASK_VALUE - m) == 0 without inf - inf NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Target query rows (tokens * G) of a prefill block and kv tokens of a kv block.
PREFILL_Q_ROWS = 512
DECODE_Q_ROWS = 16
KV_BLOCK_TOKENS = 512
# Scoped VMEM for the kernel: Mosaic reports 8.4 MiB used at 16:1 GQA, D 256, page 256, bf16,
# 512-row q and kv blocks (the largest default tiling); the default 32 MiB leaves headroom.
VMEM_LIMIT_BYTES = 32 * 1024 * 1024
# Memory budget of one lax.map batch of the reference (gathered K/V in fp32 plus scores).
REF_BATCH_BYTES = 128 * 1024 * 1024
# KV tokens per block of the XLA path: small, so a short context reads little past its end
# (every row of a step reads as many blocks as the longest one). Tiny-model fp32 decode step
# at 64 requests of ~20-token contexts: ~50 ms with 512-token blocks, 10-17 ms with 128 or 64.
XLA_KV_BLOCK_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the Pallas kernel.

    decode_q_tokens: q tokens of the block of a request with ``q_len <= decode_q_tokens``.
    prefill_q_tokens: q tokens per block of longer requests (>= decode_q_tokens).
    kv_pages_per_block: pages per streamed K/V block.
    """

    decode_q_tokens: int
    prefill_q_tokens: int
    kv_pages_per_block: int

    @classmethod
    def get_default(cls, num_tokens: int, group: int, page_size: int, pages_per_seq: int):
        decode = max(1, DECODE_Q_ROWS // group)
        prefill = max(decode, min(PREFILL_Q_ROWS // group, _round_up(num_tokens, 8)))
        pages = max(1, min(KV_BLOCK_TOKENS // page_size, pages_per_seq))
        return cls(decode, prefill, pages)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------- reference


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


def write_new_kv(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs, layer=0):
    """Scatter the step's new K/V rows into their pages of layer ``layer``; padding dropped.

    Args: kv_pages [Lyr, N, 2*Hkv, S, D], new_k/new_v [T, Hkv, D], metadata as in
    :func:`ragged_paged_attention`, layer an int or traced i32 scalar. Returns the updated
    kv_pages (one scatter into the stacked array: in place when the cache is donated).
    """
    num_layers, num_pages, _, page_size, head_dim = kv_pages.shape
    num_tokens, num_kv_heads, _ = new_k.shape
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)
    page = page_indices.at[req, pos // page_size].get(mode="clip")  # i32[T]
    page = jnp.where(valid & (pos >= 0), page, num_pages)  # i32[T]; num_pages: dropped
    offset = pos % page_size  # i32[T]
    new_kv = jnp.stack([new_k, new_v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    lyr = _layer_index(layer, num_layers)
    # One [D] row per (token, K/V head): kv_pages[lyr, page[t], j, offset[t]] = new_kv[t, j].
    # Indexing every dim but D keeps the scatter window on the contiguous minor dim, so XLA
    # scatters in place instead of relaying out the whole cache to make [2*Hkv, D] windows.
    j = jnp.arange(2 * num_kv_heads, dtype=jnp.int32)[None, :]  # i32[1, 2*Hkv]
    return kv_pages.at[lyr, page[:, None], j, offset[:, None]].set(
        new_kv.astype(kv_pages.dtype), mode="drop")


def _ref_attention(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale):
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
        kv = kv_pages.at[layer, pages].get(mode="clip")  # [P, 2*Hkv, S, D]
        kv = kv.reshape(pages_per_seq, num_kv_heads, 2, page_size, head_dim)
        kv = kv.transpose(2, 1, 0, 3, 4).reshape(2, num_kv_heads, max_kv, head_dim)
        k, v = kv[0].astype(jnp.float32), kv[1].astype(jnp.float32)  # f32[Hkv, P*S, D]
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
                               *, sm_scale: float, new_k=None, new_v=None, layer=0):
    """Pure-JAX reference (also the CPU path); same contract as :func:`ragged_paged_attention`.

    Gathers each token's request pages of layer ``layer`` in ``lax.map`` batches sized to
    ~REF_BATCH_BYTES and masks causally; never materialises a [T, R, ...] array.
    """
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer)
    if new_k is not None:
        kv_pages = write_new_kv(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens,
                                num_seqs, layer)
    o = _ref_attention(q, kv_pages, _layer_index(layer, kv_pages.shape[0]), kv_lens,
                       page_indices, cu_q_lens, num_seqs, sm_scale)
    return o if new_k is None else (o, kv_pages)


# ----------------------------------------------------------------------------- validation


def _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer):
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
    if isinstance(layer, int):
        if not 0 <= layer < kv_pages.shape[0]:
            bad(f"layer {layer} out of range for {kv_pages.shape[0]} layers")
    elif jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        bad(f"layer must be an int or an integer scalar, got {layer!r}")


# ----------------------------------------------------------------------------- kernel


def _work_items(cu_q_lens, num_seqs, num_rows, block: BlockSizes, max_items: int):
    """The (request, q block) items of the real requests, in order.

    Returns (i32[max_items] request, i32[max_items] q block, i32[1] item count); entries past
    the count repeat the last request and are never used.
    """
    ns = jnp.clip(num_seqs[0], 0, num_rows)
    cu = jnp.where(jnp.arange(num_rows + 1) <= ns, cu_q_lens, cu_q_lens[ns])
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)  # i32[R]
    bq = jnp.where(q_lens <= block.decode_q_tokens, block.decode_q_tokens, block.prefill_q_tokens)
    nblk = (q_lens + bq - 1) // bq  # i32[R]; 0 for empty and padding rows
    ends = jnp.cumsum(nblk)  # i32[R]
    i = jnp.arange(max_items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, num_rows - 1).astype(jnp.int32)
    qblk = (i - (ends[seq] - nblk[seq])).astype(jnp.int32)
    return seq, qblk, ends[-1:].astype(jnp.int32)


def _compute_dtype(q_dtype, kv_dtype):
    """Matmul operand dtype: the wider of q's and the cache's; an 8-bit (FP8) cache is upcast
    to q's dtype in VMEM (FP8 K/V halve the pages' HBM bytes, the math stays bf16/f32)."""
    if jnp.dtype(kv_dtype).itemsize == 1:
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, kv_dtype)


def _make_kernel(*, sm_scale, group, num_kv_heads, page_size, pages_per_seq, block, max_items,
                 compute_dtype, precision):
    ppb = block.kv_pages_per_block
    bkv = ppb * page_size

    def kernel(
        # Prefetch (SMEM)
        layer_ref,  # i32[1]  layer of kv_hbm to read
        kv_lens_ref,  # i32[R]
        page_indices_ref,  # i32[R * P] (flattened: 2-D SMEM arrays pad their last dim)
        cu_q_lens_ref,  # i32[R + 1]
        num_seqs_ref,  # i32[1]
        item_seq_ref,  # i32[max_items]
        item_qblk_ref,  # i32[max_items]
        num_items_ref,  # i32[1]
        # Input (HBM)
        q_hbm,  # [T, Hkv, G, D]
        kv_hbm,  # [Lyr, N, 2*Hkv, S, D]
        _zeros_hbm,  # [T, Hkv, G, D], aliased to the output
        # Output (HBM)
        o_hbm,  # [T, Hkv, G, D]
        # Scratch
        q_buf,  # [2, prefill_q_tokens, Hkv, G, D]  q rows of this / the next item
        o_buf,  # [2, prefill_q_tokens, Hkv, G, D]  output rows on their way to HBM
        kv_buf,  # [2, ppb, 2*Hkv, S, D]  K/V block being computed / being fetched
        m_scr,  # f32[Hkv, rows, 1]  running max
        l_scr,  # f32[Hkv, rows, 1]  running sum
        acc_scr,  # f32[Hkv, rows, D]  running numerator
        q_sem,  # DMA[2]
        o_sem,  # DMA[2]
        kv_sem,  # DMA[2]
        kv_state,  # i32[2] SMEM: [slot of the current item's first K/V block, already fetched]
    ):
        step = pl.program_id(0)
        num_items = num_items_ref[0]
        layer = layer_ref[0]

        def item(i):
            """Scalars of work item i (clamped into range)."""
            i = jnp.minimum(i, max_items - 1)
            r = item_seq_ref[i]
            q_start = cu_q_lens_ref[r]
            q_len = cu_q_lens_ref[r + 1] - q_start
            small = q_len <= block.decode_q_tokens
            bq = jnp.where(small, block.decode_q_tokens, block.prefill_q_tokens)
            row0 = item_qblk_ref[i] * bq  # first q row of the block within its request
            n = jnp.minimum(bq, q_len - row0)  # real q rows of the block
            ctx = kv_lens_ref[r] - q_len  # tokens before the request's first new token
            kv_end = ctx + row0 + n  # positions the block needs: [0, kv_end)
            return dict(r=r, row=q_start + row0, n=n, small=small, q_pos0=ctx + row0,
                        num_kv_blocks=(kv_end + bkv - 1) // bkv,
                        last_page=jnp.clip((kv_end + page_size - 1) // page_size - 1,
                                           0, pages_per_seq - 1))

        # ---- q / o row DMAs: one [Hkv, G, D] token row each (dynamic index on the leading T
        # dim), so nothing outside the item is touched.
        def q_copy(it, slot, t):
            return pltpu.make_async_copy(q_hbm.at[it["row"] + t], q_buf.at[slot, t], q_sem.at[slot])

        def o_copy(it, slot, t):
            return pltpu.make_async_copy(o_buf.at[slot, t], o_hbm.at[it["row"] + t], o_sem.at[slot])

        def each_row(it, fn):
            def body(t, c):
                fn(t)
                return c
            lax.fori_loop(0, it["n"], body, 0)

        # ---- K/V block DMAs: one whole [2*Hkv, S, D] page per DMA. Pages past the block's
        # causal bound re-fetch its last needed page (masked anyway), so page-table entries
        # beyond a request's pages are never read.
        def for_each_kv_copy(it, blk, slot, fn):
            def body(j, c):
                page_pos = jnp.minimum(blk * ppb + j, it["last_page"])
                page = page_indices_ref[it["r"] * pages_per_seq + page_pos]
                fn(pltpu.make_async_copy(kv_hbm.at[layer, page], kv_buf.at[slot, j],
                                         kv_sem.at[slot]))
                return c
            lax.fori_loop(0, ppb, body, 0)

        def start_kv(it, blk, slot):
            for_each_kv_copy(it, blk, slot, lambda c: c.start())

        def wait_kv(it, blk, slot):
            for_each_kv_copy(it, blk, slot, lambda c: c.wait())

        def attend_block(qslot, slot, q_tokens, visible):
            """Online-softmax update of every kv head with K/V block ``kv_buf[slot]``."""
            rows = q_tokens * group
            for h in range(num_kv_heads):
                q = q_buf[qslot, :q_tokens, h].reshape(rows, -1)  # [rows, D], token-major
                k = kv_buf[slot, :, 2 * h].reshape(bkv, -1)  # [bkv, D]
                v = kv_buf[slot, :, 2 * h + 1].reshape(bkv, -1)  # [bkv, D]
                # Mosaic matmuls need one operand dtype (no-ops when q and cache agree).
                q, k, v = (a.astype(compute_dtype) for a in (q, k, v))
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * sm_scale
                s = jnp.where(visible, s, MASK_VALUE)  # f32[rows, bkv]
                m_prev = m_scr[h, :rows]  # f32[rows, 1]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.exp(s - m_new)  # f32[rows, bkv]
                alpha = jnp.exp(m_prev - m_new)  # f32[rows, 1]
                l_scr[h, :rows] = alpha * l_scr[h, :rows] + jnp.sum(p, axis=1, keepdims=True)
                pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)
                acc_scr[h, :rows] = alpha * acc_scr[h, :rows] + pv  # f32[rows, D]
                m_scr[h, :rows] = m_new

        def run_item(it, nxt, has_next, qslot, q_tokens):
            """Attend q_buf[qslot, :q_tokens] of item ``it``; write o_buf[qslot]."""
            rows = q_tokens * group
            m_scr[:, :rows] = jnp.full((num_kv_heads, rows, 1), MASK_VALUE, jnp.float32)
            l_scr[:, :rows] = jnp.zeros((num_kv_heads, rows, 1), jnp.float32)
            acc_scr[:, :rows] = jnp.zeros((num_kv_heads, rows, acc_scr.shape[2]), jnp.float32)
            slot0 = kv_state[0]
            nb = it["num_kv_blocks"]

            @pl.when(kv_state[1] == 0)
            def _():
                start_kv(it, 0, slot0)

            # Row i is query token i // G at position q_pos0 + i // G; it sees kv position p iff
            # p - q_pos0 <= i // G, i.e. (p - q_pos0) * G <= i (no vector division).
            row = lax.broadcasted_iota(jnp.int32, (rows, bkv), 0)
            col = lax.broadcasted_iota(jnp.int32, (rows, bkv), 1)

            def kv_block(b, carry):
                slot = (slot0 + b) % 2

                @pl.when(b + 1 < nb)
                def _():
                    start_kv(it, b + 1, 1 - slot)

                @pl.when((b + 1 == nb) & has_next)
                def _():
                    start_kv(nxt, 0, 1 - slot)

                wait_kv(it, b, slot)
                visible = (b * bkv - it["q_pos0"] + col) * group <= row  # bool[rows, bkv]
                attend_block(qslot, slot, q_tokens, visible)
                return carry

            lax.fori_loop(0, nb, kv_block, 0)
            kv_state[0] = (slot0 + nb) % 2
            kv_state[1] = has_next.astype(jnp.int32)
            for h in range(num_kv_heads):
                out = acc_scr[h, :rows] / l_scr[h, :rows]  # f32[rows, D]
                o_buf[qslot, :q_tokens, h] = out.reshape(q_tokens, group, -1).astype(o_buf.dtype)

        @pl.when(step == 0)
        def _init():
            kv_state[0] = 0
            kv_state[1] = 0

            @pl.when(num_items > 0)
            def _():
                first = item(0)
                each_row(first, lambda t: q_copy(first, 0, t).start())

        @pl.when((step < num_items) & (item(step)["r"] < num_seqs_ref[0]))
        def _step():
            cur, nxt = item(step), item(step + 1)
            has_next = step + 1 < num_items
            qslot = step % 2

            @pl.when(has_next)
            def _():
                each_row(nxt, lambda t: q_copy(nxt, 1 - qslot, t).start())

            each_row(cur, lambda t: q_copy(cur, qslot, t).wait())

            @pl.when(cur["small"])
            def _():
                run_item(cur, nxt, has_next, qslot, block.decode_q_tokens)

            @pl.when(jnp.logical_not(cur["small"]))
            def _():
                run_item(cur, nxt, has_next, qslot, block.prefill_q_tokens)

            each_row(cur, lambda t: o_copy(cur, qslot, t).start())

            @pl.when(step > 0)
            def _():
                prev = item(step - 1)
                each_row(prev, lambda t: o_copy(prev, 1 - qslot, t).wait())

            @pl.when(jnp.logical_not(has_next))
            def _():
                each_row(cur, lambda t: o_copy(cur, qslot, t).wait())

    return kernel


def _pallas_attention(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                      sm_scale, block: BlockSizes | None, interpret):
    """q [T, Hq, D] -> o [T, Hq, D]; layer an i32 scalar."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, two_hkv, page_size, _ = kv_pages.shape
    num_kv_heads = two_hkv // 2
    num_rows, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    if block is None:
        block = BlockSizes.get_default(num_tokens, group, page_size, pages_per_seq)
    if not (1 <= block.decode_q_tokens <= block.prefill_q_tokens and block.kv_pages_per_block >= 1):
        raise ValueError(f"bad block sizes {block}")
    max_items = num_rows + pl.cdiv(num_tokens, block.prefill_q_tokens)
    item_seq, item_qblk, num_items = _work_items(cu_q_lens, num_seqs, num_rows, block, max_items)
    ppb = block.kv_pages_per_block
    rows = block.prefill_q_tokens * group
    compute_dtype = _compute_dtype(q.dtype, kv_pages.dtype)  # matmul operand dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    kernel = _make_kernel(sm_scale=sm_scale, group=group, num_kv_heads=num_kv_heads,
                          page_size=page_size, pages_per_seq=pages_per_seq, block=block,
                          max_items=max_items, compute_dtype=compute_dtype,
                          precision=precision)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, Hkv, G, D]
    q_rows = (block.prefill_q_tokens, num_kv_heads, group, head_dim)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(max_items,),
        in_specs=[any_spec] * 3,
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((2, *q_rows), q.dtype),  # q_buf
            pltpu.VMEM((2, *q_rows), q.dtype),  # o_buf
            pltpu.VMEM((2, ppb, two_hkv, page_size, head_dim), kv_pages.dtype),  # kv_buf
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),  # m_scr
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),  # l_scr
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # acc_scr
            pltpu.SemaphoreType.DMA((2,)),  # q_sem
            pltpu.SemaphoreType.DMA((2,)),  # o_sem
            pltpu.SemaphoreType.DMA((2,)),  # kv_sem
            pltpu.SMEM((2,), jnp.int32),  # kv_state
        ],
    )
    cost = ragged_paged_attention_cost(q.shape, kv_pages.shape, page_indices.shape,
                                       q_dtype=q.dtype, kv_dtype=kv_pages.dtype)
    zeros = jnp.zeros(q4.shape, q.dtype)  # [T, Hkv, G, D]
    o4 = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        # zeros is operand 8 + 2 (after the 8 scalar-prefetch operands, q and kv_pages).
        input_output_aliases={10: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=cost.to_pallas(),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)), kv_lens.astype(jnp.int32),
      page_indices.reshape(-1).astype(jnp.int32), cu_q_lens.astype(jnp.int32),
      num_seqs.astype(jnp.int32), item_seq, item_qblk, num_items, q4, kv_pages, zeros)
    return o4.reshape(q.shape)


# ----------------------------------------------------------------------------- write kernel


def write_window_rows(dtype, page_size: int) -> int:
    """W: rows of the cache window one write item updates, min(page size, sublane tile rows of
    ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit), so a window start (a multiple of W
    inside a page) is a tile-aligned dynamic offset along the tiled S dim."""
    return min(page_size, 8 * (4 // jnp.dtype(dtype).itemsize))


def _write_items(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_pages, page_size, window,
                 max_items):
    """Work items of the K/V write: the W-row windows the new tokens of each real request touch.

    Request r (context c = kv_lens[r] - q_len) writes positions [max(c, 0), c + q_len), like
    :func:`write_new_kv` (negative positions dropped, page-table column clipped, page ids in
    [-N, 0) wrapped, others outside [0, N) dropped). Returns i32[max_items] arrays (page id,
    window start row in the page, first step row t0, new rows n, offset of the first new row
    in the window); items past the real ones have n = 0.
    """
    num_rows, pages_per_seq = page_indices.shape
    ns = jnp.clip(num_seqs[0], 0, num_rows)
    cu = jnp.where(jnp.arange(num_rows + 1) <= ns, cu_q_lens, cu_q_lens[ns])  # i32[R+1]
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)  # i32[R]
    ctx = kv_lens - q_lens  # i32[R] position of each request's first new token
    lo, hi = jnp.maximum(ctx, 0), ctx + q_lens  # i32[R] written positions [lo, hi)
    first = lo // window  # i32[R] first window (absolute window index)
    nwin = jnp.where(hi > lo, (hi - 1) // window - first + 1, 0)  # i32[R]
    ends = jnp.cumsum(nwin)  # i32[R]
    i = jnp.arange(max_items, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, num_rows - 1)  # i32[M]
    wpos = (first[r] + i - (ends[r] - nwin[r])) * window  # i32[M] absolute window start
    p_lo = jnp.maximum(lo[r], wpos)  # i32[M]
    n = jnp.minimum(hi[r], wpos + window) - p_lo  # i32[M]
    page = page_indices[r, jnp.minimum(wpos // page_size, pages_per_seq - 1)]  # i32[M]
    page = jnp.where(page < 0, page + num_pages, page)  # as jnp indexing wraps negative ids
    n = jnp.where((i < ends[-1]) & (page >= 0) & (page < num_pages), n, 0)
    t0 = cu[r] + p_lo - ctx[r]  # i32[M]
    i32 = lambda a: a.astype(jnp.int32)
    return (i32(jnp.clip(page, 0, num_pages - 1)), i32(wpos % page_size), i32(t0), i32(n),
            i32(p_lo - wpos))


def _make_write_kernel(*, two_hkv, window, whole_page):
    def kernel(
        # Prefetch (SMEM)
        layer_ref,  # i32[1]
        page_ref,  # i32[M]  page id of the item's window
        w0_ref,  # i32[M]  window start row inside the page (a multiple of W)
        t0_ref,  # i32[M]  step row of the item's first new token
        n_ref,  # i32[M]  new rows of the item (0: nothing to do)
        off_ref,  # i32[M]  window row of the first new token
        # Input (HBM)
        new_hbm,  # [T + W, 2*Hkv, 1, D]  new K/V rows (W zero rows of padding at the end)
        _kv_in,  # [Lyr, N, 2*Hkv, S, D], aliased to kv_hbm
        # Output (HBM)
        kv_hbm,  # [Lyr, N, 2*Hkv, S, D]
        # Scratch
        win_buf,  # [2*Hkv, W, D]  the cache window
        rows_buf,  # [W, 2*Hkv, 1, D]  new rows t0 .. t0 + W
        sem,  # DMA[2]
    ):
        it = pl.program_id(0)
        n = n_ref[it]

        @pl.when(n > 0)
        def _():
            rows = slice(None) if whole_page else pl.ds(pl.multiple_of(w0_ref[it], window),
                                                        window)
            win_hbm = kv_hbm.at[layer_ref[0], page_ref[it], :, rows, :]  # [2*Hkv, W, D]
            win_in = pltpu.make_async_copy(win_hbm, win_buf, sem.at[0])
            rows_in = pltpu.make_async_copy(new_hbm.at[pl.ds(t0_ref[it], window)], rows_buf,
                                            sem.at[1])
            win_in.start()
            rows_in.start()
            win_in.wait()
            rows_in.wait()
            # Window row s takes new row j = s - off when 0 <= j < n: a static loop of selects
            # (exact for every value, -0.0 and NaN included), in f32 (exact for 8/16/32-bit).
            j = lax.broadcasted_iota(jnp.int32, win_buf.shape[1:], 0) - off_ref[it]  # [W, D]
            take = (j >= 0) & (j < n)
            for h in range(two_hkv):
                out = win_buf[h].astype(jnp.float32)  # f32[W, D]
                for k in range(window):
                    row = rows_buf[k, h].astype(jnp.float32)  # f32[1, D]
                    out = jnp.where(take & (j == k), row, out)
                win_buf[h] = out.astype(win_buf.dtype)
            win_out = pltpu.make_async_copy(win_buf, win_hbm, sem.at[0])
            win_out.start()
            win_out.wait()

    return kernel


def _pallas_write_new_kv(kv_pages, new_k, new_v, layer, kv_lens, page_indices, cu_q_lens,
                         num_seqs, *, interpret):
    """Pallas :func:`write_new_kv`: same result bit for bit, the cache updated in place.

    kv_pages [Lyr, N, 2*Hkv, S, D] (aliased to the output), new_k/new_v [T, Hkv, D], layer an
    i32 scalar. Grid: one sequential step per (request, W-row window) item, at most
    min(T, 2R + cdiv(T, W)) (each item holds >= 1 new token; a request of q tokens spans at
    most floor((q - 1) / W) + 2 windows). Each item DMAs its cache window [2*Hkv, W, D] and
    the W step rows from t0 into VMEM, places its n rows and DMAs the window back; the next
    item starts after the write-back, so items sharing a window stay ordered.
    """
    num_layers, num_pages, two_hkv, page_size, head_dim = kv_pages.shape
    num_tokens = new_k.shape[0]
    num_rows = page_indices.shape[0]
    window = write_window_rows(kv_pages.dtype, page_size)
    if page_size % window:
        raise ValueError(f"write_new_kv: page size {page_size} is not a multiple of the "
                         f"{window}-row tile of a {jnp.dtype(kv_pages.dtype).name} cache")
    max_items = max(1, min(num_tokens, 2 * num_rows + pl.cdiv(num_tokens, window)))
    items = _write_items(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                         cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
                         num_pages=num_pages, page_size=page_size, window=window,
                         max_items=max_items)
    new_kv = jnp.stack([new_k, new_v], axis=2).astype(kv_pages.dtype)  # [T, Hkv, 2, D]
    new_kv = jnp.pad(new_kv.reshape(num_tokens, two_hkv, 1, head_dim),
                     ((0, window), (0, 0), (0, 0), (0, 0)))  # [T + W, 2*Hkv, 1, D]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(max_items,),
        in_specs=[any_spec] * 2,
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((two_hkv, window, head_dim), kv_pages.dtype),  # win_buf
            pltpu.VMEM((window, two_hkv, 1, head_dim), kv_pages.dtype),  # rows_buf
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
    nbytes = 3 * max_items * two_hkv * window * head_dim * jnp.dtype(kv_pages.dtype).itemsize
    kernel = _make_write_kernel(two_hkv=two_hkv, window=window, whole_page=window == page_size)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={7: 0},  # kv_pages: operand 6 + 1 (after new_kv)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=nbytes),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)), *items, new_kv, kv_pages)


# ----------------------------------------------------------------------------- XLA path


def _softmax_init(rows: int, num_kv_heads: int, group: int, head_dim: int):
    """Empty online-softmax state: running max, sum f32[rows, Hkv, G] and acc [.., D]."""
    shape = (rows, num_kv_heads, group)
    return (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _paged_softmax(qg, kv_pages, layer, tok_pages, limit, num_blocks, bp):
    """Online softmax of each row over the keys its pages hold below ``limit``.

    qg f32[N, Hkv, G, D] scaled queries; tok_pages i32[N, W] each row's page ids (W a multiple
    of ``bp``); limit i32[N]: keys at positions < limit[n] are visible; ``num_blocks``
    (traced) blocks of ``bp`` pages are read, each row gathering its pages
    ``[N, Bp, 2*Hkv, S, D]``. Returns the (max, sum, acc) state of :func:`_softmax_init`.
    """
    n, num_kv_heads, group, head_dim = qg.shape
    page_size = kv_pages.shape[3]
    block_pos = jnp.arange(bp * page_size, dtype=jnp.int32)  # i32[Bp*S]

    def block(j, carry):
        m, l, acc = carry  # f32[N, Hkv, G], f32[N, Hkv, G], f32[N, Hkv, G, D]
        pages = lax.dynamic_slice_in_dim(tok_pages, j * bp, bp, axis=1)  # i32[N, Bp]
        kv = kv_pages.at[layer, pages].get(mode="clip")  # [N, Bp, 2*Hkv, S, D]
        kv = kv.reshape(n, bp, num_kv_heads, 2, page_size, head_dim)
        kv = kv.transpose(3, 0, 2, 1, 4, 5).reshape(2, n, num_kv_heads, bp * page_size, head_dim)
        k, v = kv[0].astype(jnp.float32), kv[1].astype(jnp.float32)  # f32[N, Hkv, Bp*S, D]
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
                   pages_per_block):
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
    _, l, acc = _paged_softmax(qg, kv_pages, layer, _padded_table(page_indices, bp)[req],
                               pos + 1, num_blocks, bp)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


PREFIX_GROUP = 16  # tokens per group of the prefix pass (the tokens that have cached keys)


def _xla_attention_split(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs,
                         sm_scale, pages_per_block, new_k, new_v):
    """Attention as two online-softmax passes merged per token (prefill-heavy steps).

    Keys written in this step (the request's own new tokens) are read densely from
    ``new_k`` / ``new_v``: scores ``[T, Hkv, G, T]`` masked to the same request and earlier
    rows, no page gather. Keys already cached before the step (the request's prefix) are read
    from the pages by :func:`_paged_softmax`, but only for the tokens whose request has a
    prefix: they are compacted and processed ``PREFIX_GROUP`` at a time, a traced number of
    groups, so a step of fresh prompts gathers no pages at all.

    Measured (tiny default, fp32, this repo's 2-core CPU): a 256-token prefill step of 4
    fresh 64-token prompts 62 -> 30 ms, a 64-request decode step 7.2 -> 5.5 ms. The in-step
    sums run in step coordinates, so a token's rounding can depend on where its request
    sits in the step: batch-invariant serving uses :func:`_xla_attention`.
    """
    T, Hq, D = q.shape
    Hkv = kv_pages.shape[2] // 2
    group = Hq // Hkv
    bp = min(pages_per_block, page_indices.shape[1])
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, T)
    t_idx = jnp.arange(T, dtype=jnp.int32)
    step_start = pos - (t_idx - cu_q_lens[req])  # position of the request's first new token
    qg = q.reshape(T, Hkv, group, D).astype(jnp.float32) * sm_scale

    # In-step keys: dense scores, same request and not later.
    kn = new_k.astype(kv_pages.dtype).astype(jnp.float32)  # as read back from the cache
    vn = new_v.astype(kv_pages.dtype).astype(jnp.float32)
    s = jnp.einsum("thgd,shd->thgs", qg, kn, precision=lax.Precision.HIGHEST)  # [T,Hkv,G,T]
    see = (req[:, None] == req[None, :]) & (t_idx[None, :] <= t_idx[:, None]) & valid[None, :]
    s = jnp.where(see[:, None, None, :], s, MASK_VALUE)
    m_b = s.max(-1)
    p = jnp.exp(s - m_b[..., None])
    l_b = p.sum(-1)
    acc_b = jnp.einsum("thgs,shd->thgd", p, vn, precision=lax.Precision.HIGHEST)

    # Cached keys (positions < step_start), for the compacted tokens that have any.
    needs = valid & (step_start > 0)
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
                                   num_blocks, bp)
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


def xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float, new_k=None, new_v=None, layer=0,
                               pages_per_block: int | None = None, batch_invariant: bool = False):
    """The serving path off TPU; same contract as :func:`ragged_paged_attention`.

    With new K/V (a serving step) it is :func:`_xla_attention_split`, unless
    ``batch_invariant``: then every token reads its keys from the pages in blocks of absolute
    positions (:func:`_xla_attention`), so its result does not depend on where in the step
    its request sits. ``pages_per_block`` defaults to ``XLA_KV_BLOCK_TOKENS // S`` (at
    least 1)."""
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer)
    if new_k is not None:
        kv_pages = write_new_kv(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens,
                                num_seqs, layer)
    bp = pages_per_block or max(1, XLA_KV_BLOCK_TOKENS // kv_pages.shape[3])
    if new_k is not None and not batch_invariant:
        o = _xla_attention_split(q, kv_pages, _layer_index(layer, kv_pages.shape[0]), kv_lens,
                                 page_indices, cu_q_lens, num_seqs, sm_scale, bp, new_k, new_v)
        return o, kv_pages
    o = _xla_attention(q, kv_pages, _layer_index(layer, kv_pages.shape[0]), kv_lens,
                       page_indices, cu_q_lens, num_seqs, sm_scale, bp)
    return o if new_k is None else (o, kv_pages)


# ----------------------------------------------------------------------------- public


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           *, sm_scale: float, new_k=None, new_v=None, layer=0, impl=None,
                           block_sizes: BlockSizes | None = None, batch_invariant: bool = False):
    """Causal GQA attention of a ragged batch of decode rows and prefill chunks over paged KV.

    Args:
      q: [T, Hq, D] queries of all new tokens, request after request.
      kv_pages: [Lyr, N, 2*Hkv, S, D] paged cache of all attention layers; K of kv head h at
        index 2*h, V at 2*h + 1.
      kv_lens: i32[R] tokens in each request's KV after this step (context + new).
      page_indices: i32[R, P] page ids of each request in order.
      cu_q_lens: i32[R + 1]; request r owns q rows cu_q_lens[r]:cu_q_lens[r+1].
      num_seqs: i32[1] real requests; later rows and tokens >= cu_q_lens[num_seqs] are padding.
      sm_scale: score scale (head_dim ** -0.5 usually).
      new_k, new_v: optional [T, Hkv, D] K/V of the new tokens, written into layer ``layer`` of
        the pages before attending (reference: XLA scatter; Pallas: the write kernel).
      layer: int (range-checked) or traced i32 scalar (clipped into range): the layer of
        kv_pages to write and read. The whole cache goes to the kernel (scalar prefetch of
        the layer index), never a per-layer slice.
      impl: see :mod:`kernels.dispatch`.
      block_sizes: Pallas tiling; default :meth:`BlockSizes.get_default`.
      batch_invariant: the XLA path reads every key from the pages in absolute-position
        blocks (a token's result does not depend on the rest of the batch; slower on
        prefill-heavy steps). The Pallas kernel and the reference always are.

    Returns:
      o [T, Hq, D] in q.dtype (zeros for padding tokens), or (o, kv_pages) when new_k / new_v
      are given.
    """
    resolved = dispatch.resolve(impl, has_xla=True)
    if resolved == "xla":
        return xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, new_k=new_k, new_v=new_v,
                                          layer=layer, batch_invariant=batch_invariant)
    if resolved == "reference":
        return ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, new_k=new_k, new_v=new_v,
                                          layer=layer)
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer)
    interpret = dispatch.interpret_params(resolved)
    if new_k is not None:
        kv_pages = _pallas_write_new_kv(kv_pages, new_k, new_v,
                                        _layer_index(layer, kv_pages.shape[0]), kv_lens,
                                        page_indices, cu_q_lens, num_seqs, interpret=interpret)
    o = _pallas_attention(q, kv_pages, _layer_index(layer, kv_pages.shape[0]), kv_lens,
                          page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                          block=block_sizes, interpret=interpret)
    return o if new_k is None else (o, kv_pages)


def ragged_paged_attention_cost(q_shape, kv_pages_shape, page_indices_shape, *,
                                q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                                write_new_kv: bool = False) -> Cost:
    """Upper-bound cost from shapes alone: every token attends to a full row of pages.

    q_shape [T, Hq, D], kv_pages_shape [Lyr, N, 2*Hkv, S, D], page_indices_shape [R, P]. Bytes:
    q read, o written, each request's pages of one layer read once (K and V, at most T * P
    pages in all), metadata; plus the new K/V rows written when ``write_new_kv``.
    """
    num_tokens, num_q_heads, head_dim = q_shape
    _, _, two_hkv, page_size, _ = kv_pages_shape
    num_rows, pages_per_seq = page_indices_shape
    q_bytes = jnp.dtype(q_dtype).itemsize
    kv_bytes = jnp.dtype(kv_dtype).itemsize
    max_kv = pages_per_seq * page_size
    pages_read = min(num_rows, max(num_tokens, 1)) * max_kv
    flops = 4 * num_tokens * num_q_heads * max_kv * head_dim  # QK^T and PV
    nbytes = (2 * num_tokens * num_q_heads * head_dim * q_bytes
              + pages_read * two_hkv * head_dim * kv_bytes
              + 4 * (num_rows * (pages_per_seq + 2) + 3))
    if write_new_kv:
        nbytes += num_tokens * two_hkv * head_dim * kv_bytes
    return Cost(flops=int(flops), bytes_accessed=int(nbytes),
                transcendentals=int(num_tokens * num_q_heads * max_kv))
