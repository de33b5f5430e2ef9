"""FP8 for the grouped matmul (``gmm.py``): block-wise e4m3 weights with their scales as the
checkpoints store them, and the activations' per-row, per-512-wide-K-sub-channel e4m3
quantisation (``quantize_lhs``), whose reference the Pallas kernel and the XLA path match
bit for bit (scales multiplied by their reciprocal, see ``fp8_scale``); and ``e4m3_as_b11``,
the in-kernel e4m3 -> f32 conversion that the FP8 KV cache's attention kernel shares."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHT_BLOCK = 128  # rhs_scale block (K and N)
LHS_QUANT_BLOCK = 512  # activation quantisation sub-channel width along K


def quantize_fp8_blockwise(w, block: int = WEIGHT_BLOCK):
    """Block-wise e4m3 quantisation of expert weights (blocks over the last two axes).

    Args:
      w: float[G, N, K] (any [G, rows, cols]).
      block: square block size (128 in the checkpoints).
    Returns:
      (w_fp8 float8_e4m3fn[G, N, K], scale f32[G, ceil(N/block), ceil(K/block)]) with
      ``w ~= w_fp8 * scale[:, n // block, k // block]``; scale = block amax / 448 (1 for an
      all-zero block), values rounded as ``w * (1 / scale)``.
    """
    if w.ndim != 3:
        raise ValueError(f"w must be [G, N, K], got shape {w.shape}")
    g, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    w32 = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, nb * block - n), (0, kb * block - k)))
    blocks = w32.reshape(g, nb, block, kb, block)  # f32[G, Nb, b, Kb, b]
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4))  # f32[G, Nb, Kb]
    scale = fp8_scale(amax)
    inv = (1.0 / scale)[:, :, None, :, None]
    q = jnp.clip(blocks * inv, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    q = q.reshape(g, nb * block, kb * block)[:, :n, :k]
    return q, scale


def dequantize_fp8_blockwise(w_fp8, scale, block: int = WEIGHT_BLOCK):
    """f32[G, N, K] = w_fp8 * scale expanded over block x block tiles."""
    _, n, k = w_fp8.shape
    s = jnp.repeat(jnp.repeat(scale, block, axis=1), block, axis=2)[:, :n, :k]
    return w_fp8.astype(jnp.float32) * s


# e4m3fn bits read as e4m3b11fnuz (exponent bias 11, not 7) are the value / 16.
B11_FACTOR = 16.0


def e4m3_as_b11(w):
    """Inside a TPU kernel: float8_e4m3fn[R, C] (R a multiple of 4) -> the same bits as
    float8_e4m3b11fnuz, whose value is w / ``B11_FACTOR``, with -0 made +0.

    Why: the TPU VPU unpacks e4m3b11 to f32 in one instruction; Mosaic converts e4m3fn by
    that unpack plus a bias multiply and NaN / range fix-ups, ~2.5x the vector ops, which
    bound the FP8 GMM on a v5e (no fp8 MXU, every weight converted). Exact for every
    finite e4m3fn value (normals and subnormals alike: the exponent field is the same, only
    its bias differs); the fn NaN (0x7f / 0xff) becomes +-30 (x16 = 480). The one bit
    pattern b11fnuz reads differently, 0x80 (fn's -0, the fnuz NaN), is cleared to +0 on the
    packed words, four bytes per u32: a byte's low 7 bits are nonzero iff adding 0x7f sets
    its bit 7 (no carry leaves the byte); the sign is kept only there.
    """
    bits = pltpu.bitcast(w, jnp.uint32)  # [R/4, C], four rows' bytes per word
    low = bits & jnp.uint32(0x7F7F7F7F)
    nonzero = (low + jnp.uint32(0x7F7F7F7F)) & jnp.uint32(0x80808080)
    bits = bits & (nonzero | jnp.uint32(0x7F7F7F7F))
    return pltpu.bitcast(bits, jnp.float8_e4m3b11fnuz)


def fp8_scale(amax):
    """amax / 448 as ``amax * f32(1/448)`` (1 where amax == 0).

    Quantisation multiplies by ``1 / scale`` rather than dividing: XLA rewrites a division by
    a broadcast into that anyway, and spelling it out makes the e4m3 rounding reproducible
    bit for bit (numpy simulation, reference and kernel agree on ties).
    """
    return jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), 1.0).astype(jnp.float32)


def quantize_rows(x32):
    """Per-row e4m3 quantisation of x32 f32[..., C] over its last axis -> (q f32, scale f32[..., 1])."""
    scale = fp8_scale(jnp.max(jnp.abs(x32), axis=-1, keepdims=True))
    q = jnp.clip(x32 * (1.0 / scale), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).astype(jnp.float32)
    return q, scale


def quantize_lhs_reference(lhs):
    """lhs quantised per row per 512-wide K sub-channel and dequantised: f32[M, K]."""
    m, k = lhs.shape
    kq = -(-k // LHS_QUANT_BLOCK)
    x = jnp.pad(lhs.astype(jnp.float32), ((0, 0), (0, kq * LHS_QUANT_BLOCK - k)))
    q, s = quantize_rows(x.reshape(m, kq, LHS_QUANT_BLOCK))  # f32[M, Kq, 512], f32[M, Kq, 1]
    return (q * s).reshape(m, kq * LHS_QUANT_BLOCK)[:, :k]
