"""Writing the step's new K/V into the paged cache: the XLA scatter and its Pallas kernel.

New K/V (``new_k``/``new_v``) are written into layer ``layer`` *before* attention: by an XLA
scatter (:func:`write_new_kv`, the reference) or, on the Pallas path, by a second Pallas kernel
(:func:`_pallas_write_new_kv`, bit-identical) that DMAs only the touched W-row windows of the
cache, in place (input_output_aliases). XLA's scatter wants another HBM tiling of the cache
than Mosaic's, so inside the model's layer scan it relaid out the whole stacked cache twice
per layer; with the Pallas write XLA never touches the cache.

An FP8 cache (``quant.py``) takes ``kv_scales`` too: the new rows are quantised once by
:func:`new_kv_rows`, both paths write them and their scales (the kernel reads, updates and
writes back each touched page's whole ``[2*Hkv, S]`` scale block, so no dynamic offset falls on
the lane dim).

Dimension letters and the metadata contract: see the package docstring; W is the number of
cache rows one write item updates (:func:`write_window_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import _layer_index, _token_metadata
from .quant import quantize_rows

# ----------------------------------------------------------------------------- reference


def new_kv_rows(new_k, new_v, kv_pages, kv_scales=None):
    """The step's new K/V as cache rows: ([T, 2*Hkv, D] in the cache dtype, K of kv head h at
    2h and V at 2h + 1, and their f32[T, 2*Hkv] scales, or None without ``kv_scales``)."""
    num_tokens, num_kv_heads, head_dim = new_k.shape
    rows = jnp.stack([new_k, new_v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    if kv_scales is None:
        return rows.astype(kv_pages.dtype), None
    return quantize_rows(rows, kv_pages.dtype)


def write_new_kv(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs, layer=0,
                 kv_scales=None):
    """Scatter the step's new K/V rows into their pages of layer ``layer``; padding dropped.

    Args: kv_pages [Lyr, N, 2*Hkv, S, D], new_k/new_v [T, Hkv, D], metadata as in
    :func:`ragged_paged_attention`, layer an int or traced i32 scalar, kv_scales
    f32[Lyr, N, 2*Hkv, S] of an FP8 cache (``quant.py``: the rows are quantised and their
    scales written beside them) or None. Returns the updated kv_pages, or (kv_pages,
    kv_scales) with scales (one scatter into each stacked array: in place when donated).
    """
    num_layers, num_pages, _, page_size, _ = kv_pages.shape
    num_tokens, num_kv_heads, _ = new_k.shape
    req, pos, valid = _token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)
    page = page_indices.at[req, pos // page_size].get(mode="clip")  # i32[T]
    page = jnp.where(valid & (pos >= 0), page, num_pages)  # i32[T]; num_pages: dropped
    offset = pos % page_size  # i32[T]
    rows, scales = new_kv_rows(new_k, new_v, kv_pages, kv_scales)  # [T, 2*Hkv, D], f32[T, 2*Hkv]
    lyr = _layer_index(layer, num_layers)
    # One [D] row per (token, K/V head): kv_pages[lyr, page[t], j, offset[t]] = rows[t, j].
    # Indexing every dim but D keeps the scatter window on the contiguous minor dim, so XLA
    # scatters in place instead of relaying out the whole cache to make [2*Hkv, D] windows.
    j = jnp.arange(2 * num_kv_heads, dtype=jnp.int32)[None, :]  # i32[1, 2*Hkv]
    idx = (lyr, page[:, None], j, offset[:, None])
    kv_pages = kv_pages.at[idx].set(rows, mode="drop")
    if kv_scales is None:
        return kv_pages
    return kv_pages, kv_scales.at[idx].set(scales, mode="drop")


# ----------------------------------------------------------------------------- kernel


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


def _place_rows(win_buf, rows_buf, off, n, window):
    """Window row s of win_buf [2*Hkv, W, D] := rows_buf[s - off] ([W, 2*Hkv, 1, D]) where
    0 <= s - off < n: a static loop of selects (exact for every value, -0.0 and NaN
    included), in f32 (exact for 8/16/32-bit)."""
    j = lax.broadcasted_iota(jnp.int32, win_buf.shape[1:], 0) - off  # [W, D]
    take = (j >= 0) & (j < n)
    for h in range(win_buf.shape[0]):
        out = win_buf[h].astype(jnp.float32)  # f32[W, D]
        for k in range(window):
            row = rows_buf[k, h].astype(jnp.float32)  # f32[1, D]
            out = jnp.where(take & (j == k), row, out)
        win_buf[h] = out.astype(win_buf.dtype)


def _place_scales(sc_buf, sc_rows_buf, first, n, window):
    """Page column s of sc_buf f32[2*Hkv, S] := sc_rows_buf[s - first] ([W, 2*Hkv, 1]) where
    0 <= s - first < n; each new scale column is a lane broadcast of a [2*Hkv, 1] row."""
    j = lax.broadcasted_iota(jnp.int32, sc_buf.shape, 1) - first  # i32[2*Hkv, S]
    take = (j >= 0) & (j < n)
    out = sc_buf[...]
    for k in range(window):
        out = jnp.where(take & (j == k), sc_rows_buf[k], out)
    sc_buf[...] = out


def _make_write_kernel(*, window, whole_page, with_scales):
    def kernel(
        # Prefetch (SMEM)
        layer_ref,  # i32[1]
        page_ref,  # i32[M]  page id of the item's window
        w0_ref,  # i32[M]  window start row inside the page (a multiple of W)
        t0_ref,  # i32[M]  step row of the item's first new token
        n_ref,  # i32[M]  new rows of the item (0: nothing to do)
        off_ref,  # i32[M]  window row of the first new token
        *refs,
    ):
        if with_scales:
            (new_hbm,  # [T + W, 2*Hkv, 1, D]  new K/V rows (W zero rows of padding at the end)
             new_sc_hbm,  # f32[T + W, 2*Hkv, 1]  their scales
             _kv_in, _sc_in,  # aliased to kv_hbm / sc_hbm
             kv_hbm,  # [Lyr, N, 2*Hkv, S, D]
             sc_hbm,  # f32[Lyr, N, 2*Hkv, S]
             win_buf,  # [2*Hkv, W, D]  the cache window
             rows_buf,  # [W, 2*Hkv, 1, D]  new rows t0 .. t0 + W
             sc_buf,  # f32[2*Hkv, S]  the page's scales (whole: no dynamic lane offset)
             sc_rows_buf,  # f32[W, 2*Hkv, 1]  scales of rows t0 .. t0 + W
             sem) = refs  # DMA[4]
        else:
            new_hbm, _kv_in, kv_hbm, win_buf, rows_buf, sem = refs
        it = pl.program_id(0)
        n = n_ref[it]

        @pl.when(n > 0)
        def _():
            rows = slice(None) if whole_page else pl.ds(pl.multiple_of(w0_ref[it], window),
                                                        window)
            layer, page, t0 = layer_ref[0], page_ref[it], t0_ref[it]
            win_hbm = kv_hbm.at[layer, page, :, rows, :]  # [2*Hkv, W, D]
            copies = [pltpu.make_async_copy(win_hbm, win_buf, sem.at[0]),
                      pltpu.make_async_copy(new_hbm.at[pl.ds(t0, window)], rows_buf, sem.at[1])]
            if with_scales:
                copies += [pltpu.make_async_copy(sc_hbm.at[layer, page], sc_buf, sem.at[2]),
                           pltpu.make_async_copy(new_sc_hbm.at[pl.ds(t0, window)],
                                                 sc_rows_buf, sem.at[3])]
            for c in copies:
                c.start()
            for c in copies:
                c.wait()
            _place_rows(win_buf, rows_buf, off_ref[it], n, window)
            outs = [pltpu.make_async_copy(win_buf, win_hbm, sem.at[0])]
            if with_scales:
                _place_scales(sc_buf, sc_rows_buf, w0_ref[it] + off_ref[it], n, window)
                outs.append(pltpu.make_async_copy(sc_buf, sc_hbm.at[layer, page], sem.at[2]))
            for c in outs:
                c.start()
            for c in outs:
                c.wait()

    return kernel


# ----------------------------------------------------------------------------- wrapper


def _pallas_write_new_kv(kv_pages, new_k, new_v, layer, kv_lens, page_indices, cu_q_lens,
                         num_seqs, *, interpret, kv_scales=None):
    """Pallas :func:`write_new_kv`: same result bit for bit, the cache updated in place.

    kv_pages [Lyr, N, 2*Hkv, S, D] (aliased to the output), new_k/new_v [T, Hkv, D], layer an
    i32 scalar, kv_scales f32[Lyr, N, 2*Hkv, S] or None (aliased too; returns (kv_pages,
    kv_scales) then). Grid: one sequential step per (request, W-row window) item, at most
    min(T, 2R + cdiv(T, W)) (each item holds >= 1 new token; a request of q tokens spans at
    most floor((q - 1) / W) + 2 windows). Each item DMAs its cache window [2*Hkv, W, D] and
    the W step rows from t0 into VMEM, places its n rows and DMAs the window back (with
    scales, the same for the page's whole scale block [2*Hkv, S]); the next item starts after
    the write-back, so items sharing a window stay ordered. The rows are quantised before
    the kernel, by the function the XLA scatter uses (:func:`new_kv_rows`).
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
    rows, scales = new_kv_rows(new_k, new_v, kv_pages, kv_scales)  # [T, 2*Hkv, D], f32[T, 2*Hkv]
    pad = ((0, window), (0, 0), (0, 0))
    new_kv = jnp.pad(rows[:, :, None], pad + ((0, 0),))  # [T + W, 2*Hkv, 1, D]
    operands, scratch = [new_kv], [
        pltpu.VMEM((two_hkv, window, head_dim), kv_pages.dtype),  # win_buf
        pltpu.VMEM((window, two_hkv, 1, head_dim), kv_pages.dtype)]  # rows_buf
    with_scales = kv_scales is not None
    if with_scales:
        operands.append(jnp.pad(scales[:, :, None], pad))  # f32[T + W, 2*Hkv, 1]
        scratch += [pltpu.VMEM((two_hkv, page_size), jnp.float32),  # sc_buf
                    pltpu.VMEM((window, two_hkv, 1), jnp.float32)]  # sc_rows_buf
    caches = [kv_pages] + ([kv_scales] if with_scales else [])
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(max_items,),
        in_specs=[any_spec] * (len(operands) + len(caches)),
        out_specs=[any_spec] * len(caches),
        scratch_shapes=scratch + [pltpu.SemaphoreType.DMA((4 if with_scales else 2,))],
    )
    nbytes = 3 * max_items * two_hkv * window * head_dim * jnp.dtype(kv_pages.dtype).itemsize
    if with_scales:
        nbytes += 2 * max_items * two_hkv * page_size * 4
    kernel = _make_write_kernel(window=window, whole_page=window == page_size,
                                with_scales=with_scales)
    first_cache = 6 + len(operands)  # operand index of kv_pages (after prefetch and new rows)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={first_cache + i: i for i in range(len(caches))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=nbytes),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)), *items, *operands, *caches)
    return tuple(out) if with_scales else out[0]


# ----------------------------------------------------------------------------- helpers


def _write(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs, layer,
           kv_scales):
    """:func:`write_new_kv` returning (kv_pages, kv_scales or None) either way."""
    out = write_new_kv(kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs,
                       layer, kv_scales)
    return out if kv_scales is not None else (out, None)


def _outputs(o, kv_pages, kv_scales, wrote: bool):
    """What ragged paged attention returns: o; (o, kv_pages) after a write; (o, kv_pages,
    kv_scales) after a write into a scaled (FP8) cache."""
    if not wrote:
        return o
    return (o, kv_pages) if kv_scales is None else (o, kv_pages, kv_scales)
