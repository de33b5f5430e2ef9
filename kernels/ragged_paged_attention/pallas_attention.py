"""The Pallas TPU kernel of ragged paged attention, its wrapper and its cost model.

Dimension letters and the metadata contract: see the package docstring. The new K/V are
written into the cache before this kernel runs, by the kernel in ``kv_write``.

Kernel layout:
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
  * an FP8 cache with scales (``quant.py``): each page's f32 ``[2 * Hkv, S]`` scale block is
    DMA'd beside it into ``[2, pages_per_block, 2 * Hkv, S]``; a kv head's K (V) scales of
    the block are one ``[1, pages_per_block * S]`` lane row (pages concatenated along lanes)
    that multiplies the score columns (the probabilities before P @ V), so no scale moves
    from lanes to sublanes.
  * online softmax per kv head over ``[q_tokens * G, D]`` query rows (the G query heads of a
    kv head stacked token-major), running max / sum / accumulator in fp32 VMEM scratch;
    K/V blocks that the causal bound does not cut skip the mask. A prefill item updates the
    softmax once per sub-block of ``PREFILL_KV_SUB_TOKENS`` keys of the DMA'd block (whole
    pages, static slices; the whole block when the pages do not divide that way), so its
    score block is ``[prefill rows, sub-block keys]``, and skips a sub-block that no row's
    causal bound reaches; decode items take the whole block.
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

from .. import block_tables
from ..cost import Cost
from ..gmm_quant import B11_FACTOR, e4m3_as_b11
from .common import MASK_VALUE

# Target query rows (tokens * G) of a prefill block and kv tokens of a kv block.
PREFILL_Q_ROWS = 512
DECODE_Q_ROWS = 16
KV_BLOCK_TOKENS = 512
# Keys per online-softmax update of a prefill item (a sub-block of whole pages of the K/V
# block; the DMA block stays KV_BLOCK_TOKENS). A sub-block past every row's causal bound is
# skipped. On a v5e at the 397B prefill shape (one run, 2026-12-07): 1.931 -> 1.875 ms, decode
# unchanged (0.368 / 0.361 ms at 2K, 1.429 / 1.432 at 8K).
PREFILL_KV_SUB_TOKENS = 256
# Scoped VMEM for the kernel: Mosaic reports 7.7 MiB used on a TPU7x (8.2 MiB on a v5e) at
# 16:1 GQA, D 256, page 256, bf16, 512-row q and kv blocks, 256-key prefill sub-blocks (the
# largest default tiling; tests/tpu/test_attention_compile.py compiles it and checks the VMEM
# used); the default 32 MiB leaves headroom.
VMEM_LIMIT_BYTES = 32 * 1024 * 1024
# Lanes of the running max / sum scratch: each row's value is replicated across one lane tile,
# so it widens to a score block or an accumulator row by copying whole vregs (``_lanes``), not
# by a cross-lane broadcast per use.
STAT_LANES = 128
LOG2E = 1.4426950408889634


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

    def valid(self) -> bool:
        return 1 <= self.decode_q_tokens <= self.prefill_q_tokens and self.kv_pages_per_block >= 1

    @classmethod
    def get_default(cls, num_tokens: int, group: int, page_size: int, pages_per_seq: int):
        decode = max(1, DECODE_Q_ROWS // group)
        prefill = max(decode, min(PREFILL_Q_ROWS // group, _round_up(num_tokens, 8)))
        pages = max(1, min(KV_BLOCK_TOKENS // page_size, pages_per_seq))
        return cls(decode, prefill, pages)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sub_pages(pages_per_block: int, page_size: int) -> int:
    """Pages per online-softmax update of a prefill item: ``PREFILL_KV_SUB_TOKENS`` keys'
    worth (at least one page), or the whole block when that does not divide it."""
    sub = max(1, min(pages_per_block, PREFILL_KV_SUB_TOKENS // page_size))
    return sub if pages_per_block % sub == 0 else pages_per_block


def _lanes(x, width: int):
    """f32[rows, STAT_LANES] lane-replicated -> a value that broadcasts against [rows, width]:
    whole lane tiles side by side when width is a multiple of STAT_LANES, else one column."""
    if width % STAT_LANES == 0:
        return jnp.tile(x, (1, width // STAT_LANES))
    return x[:, :1]


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
                 compute_dtype, precision, with_scales):
    ppb = block.kv_pages_per_block
    bkv = ppb * page_size
    prefill_sub = _sub_pages(ppb, page_size)
    score_scale = sm_scale * LOG2E  # scores in log2 units: exp2(s - m) is the softmax's exp

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
        *refs,
    ):
        # Input (HBM): q_hbm [T, Hkv, G, D], kv_hbm [Lyr, N, 2*Hkv, S, D], with scales sc_hbm
        #   f32[Lyr, N, 2*Hkv, S], _zeros_hbm [T, Hkv, G, D] (aliased to the output).
        # Output (HBM): o_hbm [T, Hkv, G, D].
        # Scratch: q_buf / o_buf [2, prefill_q_tokens, Hkv, G, D] (q rows of this / the next
        #   item, output rows on their way to HBM); kv_buf [2, ppb, 2*Hkv, S, D] (K/V block
        #   being computed / being fetched), with scales sc_buf f32[2, ppb, 2*Hkv, S] beside
        #   it; m_scr / l_scr f32[Hkv, rows, STAT_LANES] running max (log2 units) / sum,
        #   acc_scr f32[Hkv, rows, D] running numerator; q_sem, o_sem, kv_sem DMA[2];
        #   kv_state i32[2] SMEM (slot of the current item's first K/V block, already
        #   fetched).
        if with_scales:
            (q_hbm, kv_hbm, sc_hbm, _zeros_hbm, o_hbm, q_buf, o_buf, kv_buf, sc_buf, m_scr,
             l_scr, acc_scr, q_sem, o_sem, kv_sem, kv_state) = refs
        else:
            (q_hbm, kv_hbm, _zeros_hbm, o_hbm, q_buf, o_buf, kv_buf, m_scr, l_scr, acc_scr,
             q_sem, o_sem, kv_sem, kv_state) = refs
            sc_hbm = sc_buf = None
        e4m3 = with_scales and kv_hbm.dtype == jnp.float8_e4m3fn
        head_dim = acc_scr.shape[2]
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
                        kv_end=kv_end,
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

        # ---- K/V block DMAs: one whole [2*Hkv, S, D] page per DMA (and its [2*Hkv, S] scale
        # block). Pages past the block's causal bound re-fetch its last needed page (masked
        # anyway), so page-table entries beyond a request's pages are never read.
        def for_each_kv_copy(it, blk, slot, fn):
            def body(j, c):
                page_pos = jnp.minimum(blk * ppb + j, it["last_page"])
                page = page_indices_ref[it["r"] * pages_per_seq + page_pos]
                fn(pltpu.make_async_copy(kv_hbm.at[layer, page], kv_buf.at[slot, j],
                                         kv_sem.at[slot]))
                if with_scales:
                    fn(pltpu.make_async_copy(sc_hbm.at[layer, page], sc_buf.at[slot, j],
                                             kv_sem.at[slot]))
                return c
            lax.fori_loop(0, ppb, body, 0)

        def start_kv(it, blk, slot):
            for_each_kv_copy(it, blk, slot, lambda c: c.start())

        def wait_kv(it, blk, slot):
            for_each_kv_copy(it, blk, slot, lambda c: c.wait())

        def scale_row(slot, j, j0, sub):
            """f32[1, sub * S]: row j (2h: K, 2h + 1: V of kv head h) of the scales of pages
            j0 .. j0 + sub - 1 of block ``slot``, pages side by side along lanes (no sublane ->
            lane transpose)."""
            return jnp.concatenate([sc_buf[slot, b, j:j + 1, :] for b in range(j0, j0 + sub)],
                                   axis=1)

        def attend_block(qslot, slot, q_tokens, sub, visible, live=None):
            """Online-softmax update of every kv head with K/V block ``kv_buf[slot]``, one
            update per sub-block of ``sub`` pages (w = sub * S keys). In a block the causal
            bound cuts, visible(c0) -> bool[rows, w] masks the sub-block of block keys
            c0 .. c0 + w - 1 and live(c0) -> bool says whether any row sees key c0: a later
            sub-block that no row sees is skipped (visible, live None: every key is visible).
            Scores are kept in log2 units (scaled by sm_scale * log2 e, so exp2 needs no
            second multiply). With scales, a key's scale multiplies its score column and a
            value's scale its probability column before P @ V: the same as attending to the
            dequantised rows."""
            rows = q_tokens * group
            w = sub * page_size
            b11 = e4m3 and w % 4 == 0  # K/V read as e4m3b11 (value / 16), see gmm_quant
            kv_factor = B11_FACTOR if b11 else 1.0

            def update(h, j0, q):
                """Fold keys j0 * S .. j0 * S + w - 1 of the block into kv head h's state."""
                k = kv_buf[slot, j0:j0 + sub, 2 * h].reshape(w, -1)  # [w, D]
                v = kv_buf[slot, j0:j0 + sub, 2 * h + 1].reshape(w, -1)  # [w, D]
                if b11:  # one VPU unpack instead of Mosaic's e4m3fn conversion
                    k, v = e4m3_as_b11(k), e4m3_as_b11(v)
                # Mosaic matmuls need one operand dtype (no-ops when q and cache agree).
                q, k, v = (a.astype(compute_dtype) for a in (q, k, v))
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * score_scale
                if with_scales:
                    s = s * (scale_row(slot, 2 * h, j0, sub) * kv_factor)
                if visible is not None:
                    s = jnp.where(visible(j0 * page_size), s, MASK_VALUE)  # f32[rows, w]
                m_prev = m_scr[h, :rows]  # f32[rows, STAT_LANES], lane-replicated
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.exp2(s - _lanes(m_new, w))  # f32[rows, w]
                alpha = jnp.exp2(m_prev - m_new)  # f32[rows, STAT_LANES]
                l_scr[h, :rows] = alpha * l_scr[h, :rows] + jnp.sum(p, axis=1, keepdims=True)
                if with_scales:
                    p = p * (scale_row(slot, 2 * h + 1, j0, sub) * kv_factor)
                pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)
                acc_scr[h, :rows] = _lanes(alpha, head_dim) * acc_scr[h, :rows] + pv
                m_scr[h, :rows] = m_new

            for h in range(num_kv_heads):
                q = q_buf[qslot, :q_tokens, h].reshape(rows, -1)  # [rows, D], token-major
                for j0 in range(0, ppb, sub):
                    if live is None or j0 == 0:  # a needed block's first key is always seen
                        update(h, j0, q)
                    else:
                        pl.when(live(j0 * page_size))(lambda h=h, j0=j0, q=q: update(h, j0, q))

        def run_item(it, nxt, has_next, qslot, q_tokens, sub):
            """Attend q_buf[qslot, :q_tokens] of item ``it`` in softmax updates of ``sub``
            pages; write o_buf[qslot]."""
            rows = q_tokens * group
            w = sub * page_size
            stats = (num_kv_heads, rows, STAT_LANES)
            m_scr[:, :rows] = jnp.full(stats, MASK_VALUE, jnp.float32)
            l_scr[:, :rows] = jnp.zeros(stats, jnp.float32)
            acc_scr[:, :rows] = jnp.zeros((num_kv_heads, rows, acc_scr.shape[2]), jnp.float32)
            slot0 = kv_state[0]
            nb = it["num_kv_blocks"]

            @pl.when(kv_state[1] == 0)
            def _():
                start_kv(it, 0, slot0)

            # Row i is query token i // G at position q_pos0 + i // G; it sees kv position p iff
            # p - q_pos0 <= i // G, i.e. (p - q_pos0) * G <= i (no vector division).
            row = lax.broadcasted_iota(jnp.int32, (rows, w), 0)
            col = lax.broadcasted_iota(jnp.int32, (rows, w), 1)

            def kv_block(b, carry, masked):
                slot = (slot0 + b) % 2

                @pl.when(b + 1 < nb)
                def _():
                    start_kv(it, b + 1, 1 - slot)

                @pl.when((b + 1 == nb) & has_next)
                def _():
                    start_kv(nxt, 0, 1 - slot)

                wait_kv(it, b, slot)
                if not masked:
                    attend_block(qslot, slot, q_tokens, sub, None)
                    return carry

                def visible(c0):  # c0: the sub-block's first key within the block
                    return (b * bkv + c0 - it["q_pos0"] + col) * group <= row

                def live(c0):
                    return b * bkv + c0 < it["kv_end"]

                attend_block(qslot, slot, q_tokens, sub, visible, live)
                return carry

            # Blocks whose last key is at or before the item's first query position are seen
            # whole by every row: no mask. The rest (those the causal bound cuts) are masked.
            num_whole = jnp.minimum(nb, (it["q_pos0"] + 1) // bkv)
            lax.fori_loop(0, num_whole, lambda b, c: kv_block(b, c, False), 0)
            lax.fori_loop(num_whole, nb, lambda b, c: kv_block(b, c, True), 0)
            kv_state[0] = (slot0 + nb) % 2
            kv_state[1] = has_next.astype(jnp.int32)
            for h in range(num_kv_heads):
                out = acc_scr[h, :rows] / _lanes(l_scr[h, :rows], head_dim)  # f32[rows, D]
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
                run_item(cur, nxt, has_next, qslot, block.decode_q_tokens, ppb)

            @pl.when(jnp.logical_not(cur["small"]))
            def _():
                run_item(cur, nxt, has_next, qslot, block.prefill_q_tokens, prefill_sub)

            each_row(cur, lambda t: o_copy(cur, qslot, t).start())

            @pl.when(step > 0)
            def _():
                prev = item(step - 1)
                each_row(prev, lambda t: o_copy(prev, 1 - qslot, t).wait())

            @pl.when(jnp.logical_not(has_next))
            def _():
                each_row(cur, lambda t: o_copy(cur, qslot, t).wait())

    return kernel


# ----------------------------------------------------------------------------- wrapper


def _pallas_attention(q, kv_pages, layer, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                      sm_scale, block: BlockSizes | None, interpret, kv_scales=None):
    """q [T, Hq, D] -> o [T, Hq, D]; layer an i32 scalar; kv_scales f32[Lyr, N, 2*Hkv, S] of
    an FP8 cache (``quant.py``) or None."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, two_hkv, page_size, _ = kv_pages.shape
    num_kv_heads = two_hkv // 2
    num_rows, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    if block is None:  # the shape's default, or this TPU generation's table pick where legal
        block = block_tables.pick(
            "attention", BlockSizes.get_default(num_tokens, group, page_size, pages_per_seq),
            lambda b: b.valid() and b.kv_pages_per_block <= pages_per_seq)
    if not block.valid():
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
                          precision=precision, with_scales=kv_scales is not None)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, Hkv, G, D]
    q_rows = (block.prefill_q_tokens, num_kv_heads, group, head_dim)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    caches = [kv_pages] + ([kv_scales] if kv_scales is not None else [])
    sc_buf = ([pltpu.VMEM((2, ppb, two_hkv, page_size), jnp.float32)]
              if kv_scales is not None else [])
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(max_items,),
        in_specs=[any_spec] * (2 + len(caches)),
        out_specs=any_spec,
        scratch_shapes=[
            pltpu.VMEM((2, *q_rows), q.dtype),  # q_buf
            pltpu.VMEM((2, *q_rows), q.dtype),  # o_buf
            pltpu.VMEM((2, ppb, two_hkv, page_size, head_dim), kv_pages.dtype),  # kv_buf
            *sc_buf,  # f32[2, ppb, 2*Hkv, S] with scales
            pltpu.VMEM((num_kv_heads, rows, STAT_LANES), jnp.float32),  # m_scr
            pltpu.VMEM((num_kv_heads, rows, STAT_LANES), jnp.float32),  # l_scr
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # acc_scr
            pltpu.SemaphoreType.DMA((2,)),  # q_sem
            pltpu.SemaphoreType.DMA((2,)),  # o_sem
            pltpu.SemaphoreType.DMA((2,)),  # kv_sem
            pltpu.SMEM((2,), jnp.int32),  # kv_state
        ],
    )
    cost = ragged_paged_attention_cost(q.shape, kv_pages.shape, page_indices.shape,
                                       q_dtype=q.dtype, kv_dtype=kv_pages.dtype,
                                       kv_scales=kv_scales is not None)
    zeros = jnp.zeros(q4.shape, q.dtype)  # [T, Hkv, G, D]
    o4 = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        # zeros follows the 8 scalar-prefetch operands, q and the cache arrays.
        input_output_aliases={9 + len(caches): 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=cost.to_pallas(),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)), kv_lens.astype(jnp.int32),
      page_indices.reshape(-1).astype(jnp.int32), cu_q_lens.astype(jnp.int32),
      num_seqs.astype(jnp.int32), item_seq, item_qblk, num_items, q4, *caches, zeros)
    return o4.reshape(q.shape)


# ----------------------------------------------------------------------------- cost


def ragged_paged_attention_cost(q_shape, kv_pages_shape, page_indices_shape, *,
                                q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                                write_new_kv: bool = False, kv_scales: bool = False) -> Cost:
    """Upper-bound cost from shapes alone: every token attends to a full row of pages.

    q_shape [T, Hq, D], kv_pages_shape [Lyr, N, 2*Hkv, S, D], page_indices_shape [R, P]. Bytes:
    q read, o written, each request's pages of one layer read once (K and V, at most T * P
    pages in all), metadata; plus the new K/V rows written when ``write_new_kv``. With ``kv_scales`` (an
    FP8 cache) each K/V row also moves its f32 scale.
    """
    num_tokens, num_q_heads, head_dim = q_shape
    _, _, two_hkv, page_size, _ = kv_pages_shape
    num_rows, pages_per_seq = page_indices_shape
    q_bytes = jnp.dtype(q_dtype).itemsize
    kv_bytes = jnp.dtype(kv_dtype).itemsize
    row_bytes = head_dim * kv_bytes + (4 if kv_scales else 0)  # one cached K or V row
    max_kv = pages_per_seq * page_size
    pages_read = min(num_rows, max(num_tokens, 1)) * max_kv
    flops = 4 * num_tokens * num_q_heads * max_kv * head_dim  # QK^T and PV
    nbytes = (2 * num_tokens * num_q_heads * head_dim * q_bytes
              + pages_read * two_hkv * row_bytes
              + 4 * (num_rows * (pages_per_seq + 2) + 3))
    if write_new_kv:
        nbytes += num_tokens * two_hkv * row_bytes
    return Cost(flops=int(flops), bytes_accessed=int(nbytes),
                transcendentals=int(num_tokens * num_q_heads * max_kv))
