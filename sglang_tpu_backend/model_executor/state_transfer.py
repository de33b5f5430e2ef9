"""Copy one request's cache state between the device cache and host numpy arrays.

What a request owns in ``models/qwen3_5_moe.ModelCache`` (one device, no DP/TP split):
  kv:   [La, n, 2*G, page, D]   its n KV pages of every attention layer (La layers)
  conv: [Lg, rows, C]           its state slot's conv state of every GDN layer (Lg layers)
  rec:  [Lg, Hv, Dk, Dv]        its state slot's recurrent state of every GDN layer
``gather_state`` reads them out (prefill side of a handover), ``scatter_state`` writes them
into other pages and another slot (decode side), the cache donated and updated in place.
Both are jitted once per page-count bucket (powers of two): the page list is padded with
index ``num_pages`` (out of range), which the gather clamps (rows sliced off after) and the
scatter drops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.models.qwen3_5_moe import ModelCache


def page_bucket(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def _pad_pages(pages: list[int], num_pages: int) -> np.ndarray:
    out = np.full(page_bucket(len(pages)), num_pages, np.int32)  # i32[B], pad = out of range
    out[: len(pages)] = pages
    return out


@jax.jit
def _gather(cache: ModelCache, pages, slot):
    """pages: i32[B]; slot: i32[] -> (kv [La, B, 2G, page, D], conv [Lg, rows, C], rec [Lg, Hv, Dk, Dv])."""
    kv = jnp.take(cache.kv_pages, pages, axis=1, mode="clip")
    return kv, cache.conv_state[:, slot], cache.rec_state[:, slot]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(cache: ModelCache, kv, conv, rec, pages, slot) -> ModelCache:
    """Write kv [La, B, 2G, page, D] at pages i32[B] (pad entries dropped) and the GDN states
    conv [Lg, rows, C] / rec [Lg, Hv, Dk, Dv] at slot i32[]."""
    return ModelCache(
        kv_pages=cache.kv_pages.at[:, pages].set(kv.astype(cache.kv_pages.dtype), mode="drop"),
        conv_state=cache.conv_state.at[:, slot].set(conv.astype(cache.conv_state.dtype)),
        rec_state=cache.rec_state.at[:, slot].set(rec.astype(cache.rec_state.dtype)),
    )


def gather_state(cache: ModelCache, pages: list[int], slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host copies of the request's KV pages (in ``pages`` order) and GDN states of ``slot``."""
    idx = _pad_pages(pages, cache.num_pages)
    kv, conv, rec = jax.device_get(_gather(cache, idx, np.int32(slot)))
    return np.asarray(kv[:, : len(pages)]), np.asarray(conv), np.asarray(rec)


def scatter_state(cache: ModelCache, kv: np.ndarray, conv: np.ndarray, rec: np.ndarray,
                  pages: list[int], slot: int) -> ModelCache:
    """``cache`` with ``kv[:, i]`` written to page ``pages[i]`` and the states to ``slot``.

    kv: [La, n, 2G, page, D] with n == len(pages); conv/rec as returned by ``gather_state``.
    """
    La, n, H2, P, D = cache.kv_pages.shape[0], len(pages), *cache.kv_pages.shape[2:]
    if kv.shape != (La, n, H2, P, D):
        raise ValueError(f"kv of shape {kv.shape} does not fit {n} pages of this cache "
                         f"(expected {(La, n, H2, P, D)})")
    if conv.shape != cache.conv_state.shape[:1] + cache.conv_state.shape[2:]:
        raise ValueError(f"conv state of shape {conv.shape} does not fit this cache's "
                         f"{cache.conv_state.shape}")
    if rec.shape != cache.rec_state.shape[:1] + cache.rec_state.shape[2:]:
        raise ValueError(f"recurrent state of shape {rec.shape} does not fit this cache's "
                         f"{cache.rec_state.shape}")
    idx = _pad_pages(pages, cache.num_pages)
    padded = np.zeros((La, len(idx), H2, P, D), kv.dtype)
    padded[:, :n] = kv
    return _scatter(cache, padded, conv, rec, idx, np.int32(slot))
