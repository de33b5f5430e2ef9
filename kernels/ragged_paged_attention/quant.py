"""The FP8 KV cache: per-token, per-kv-head scales beside float8_e4m3fn pages.

With a quantised cache, ``kv_scales f32[Lyr, N, 2*Hkv, S]`` sits beside ``kv_pages
[Lyr, N, 2*Hkv, S, D]`` (same leading dims: the scale of row ``kv_pages[l, n, j, s]`` is
``kv_scales[l, n, j, s]``; K of kv head h at j = 2h, V at 2h + 1). A row x f32[D] is stored as
``fp8(x / scale)`` with ``scale = max|x| / FP8_MAX`` (1 for an all-zero row), so its largest
element lands on the format's largest finite value and the row keeps e4m3's relative
precision whatever its range; it reads back as ``fp8 * scale``.

Quantisation happens once, on the step's new K/V rows (``quantize_rows``), before any write
path places them: the XLA scatter and the Pallas write kernel store the same bits.
"""

from __future__ import annotations

import jax.numpy as jnp

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: the largest finite e4m3fn value


def is_quantized(dtype) -> bool:
    """Whether a cache of ``dtype`` holds scaled rows (an 8-bit float: FP8 pages)."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def scales_shape(kv_pages_shape) -> tuple[int, ...]:
    """[Lyr, N, 2*Hkv, S] of pages [Lyr, N, 2*Hkv, S, D]: one f32 scale per cached row."""
    return tuple(kv_pages_shape[:4])


def quantize_rows(x, dtype):
    """x [..., D] (any float dtype) -> (``dtype`` [..., D] values, f32[...] scales).

    scale = max|x| / FP8_MAX over D (1 where the row is all zero or not finite), value =
    x / scale rounded to nearest in ``dtype`` (clipped to its finite range first).
    """
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    ok = (amax > 0) & jnp.isfinite(amax)
    scale = jnp.where(ok, amax / FP8_MAX, 1.0)
    q = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(dtype)
    return q, scale


def dequantize(values, scales):
    """values [..., D], f32[...] scales -> f32[..., D]."""
    return values.astype(jnp.float32) * scales[..., None]
