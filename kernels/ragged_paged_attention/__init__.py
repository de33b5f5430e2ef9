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

FP8 cache (``quant``): ``kv_scales f32[Lyr, N, 2*Hkv, S]`` beside float8_e4m3fn pages holds
one scale per cached row (per token and K/V head); every path takes it as ``kv_scales``.

Modules: ``common`` (the per-token metadata and input validation every path shares),
``quant`` (the FP8 rows' scales),
``reference`` (the pure-JAX oracle), ``kv_write`` (the new K/V written into the cache: an XLA
scatter and its Pallas kernel), ``pallas_attention`` (the TPU kernel, its tiling and cost
model), ``xla`` (the path off TPU). :func:`ragged_paged_attention` picks one by ``impl``.
"""

from __future__ import annotations

from .. import dispatch
from .common import MASK_VALUE, _layer_index, _validate
from .kv_write import _outputs, _pallas_write_new_kv, new_kv_rows, write_new_kv, write_window_rows
from .pallas_attention import (DECODE_Q_ROWS, KV_BLOCK_TOKENS, PREFILL_Q_ROWS, VMEM_LIMIT_BYTES,
                               BlockSizes, _pallas_attention, ragged_paged_attention_cost)
from .quant import FP8_MAX, dequantize, is_quantized, quantize_rows, scales_shape
from .reference import REF_BATCH_BYTES, ref_ragged_paged_attention
from .xla import PREFIX_GROUP, XLA_KV_BLOCK_TOKENS, xla_ragged_paged_attention

__all__ = ["BlockSizes", "DECODE_Q_ROWS", "FP8_MAX", "KV_BLOCK_TOKENS", "MASK_VALUE",
           "PREFILL_Q_ROWS", "PREFIX_GROUP", "REF_BATCH_BYTES", "VMEM_LIMIT_BYTES",
           "XLA_KV_BLOCK_TOKENS", "dequantize", "is_quantized", "new_kv_rows",
           "quantize_rows", "ragged_paged_attention", "ragged_paged_attention_cost",
           "ref_ragged_paged_attention", "scales_shape", "write_new_kv", "write_window_rows", "xla_ragged_paged_attention"]


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           *, sm_scale: float, new_k=None, new_v=None, layer=0, impl=None,
                           block_sizes: BlockSizes | None = None, batch_invariant: bool = False,
                           kv_scales=None):
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
      impl: see ``kernels/dispatch.py``.
      block_sizes: Pallas tiling; default :meth:`BlockSizes.get_default`.
      batch_invariant: the XLA path reads every key from the pages in absolute-position
        blocks (a token's result does not depend on the rest of the batch; slower on
        prefill-heavy steps). The Pallas kernel and the reference always are.
      kv_scales: f32[Lyr, N, 2*Hkv, S] per-row scales of an FP8 cache (``quant.py``): new
        rows are quantised and written with their scales, cached rows read as fp8 * scale.

    Returns:
      o [T, Hq, D] in q.dtype (zeros for padding tokens); (o, kv_pages) when new_k / new_v
      are given; (o, kv_pages, kv_scales) when they are and kv_scales is.
    """
    resolved = dispatch.resolve(impl, has_xla=True)
    if resolved == "xla":
        return xla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, new_k=new_k, new_v=new_v,
                                          layer=layer, batch_invariant=batch_invariant,
                                          kv_scales=kv_scales)
    if resolved == "reference":
        return ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, new_k=new_k, new_v=new_v,
                                          layer=layer, kv_scales=kv_scales)
    _validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new_k, new_v, layer,
              kv_scales)
    interpret = dispatch.interpret_params(resolved)
    lyr = _layer_index(layer, kv_pages.shape[0])
    if new_k is not None:
        written = _pallas_write_new_kv(kv_pages, new_k, new_v, lyr, kv_lens, page_indices,
                                       cu_q_lens, num_seqs, interpret=interpret,
                                       kv_scales=kv_scales)
        kv_pages, kv_scales = written if kv_scales is not None else (written, None)
    o = _pallas_attention(q, kv_pages, lyr, kv_lens, page_indices, cu_q_lens, num_seqs,
                          sm_scale=sm_scale, block=block_sizes, interpret=interpret,
                          kv_scales=kv_scales)
    return _outputs(o, kv_pages, kv_scales, new_k is not None)
