"""Small building blocks shared by the model: norms, rotary embedding, SwiGLU.

Dimension letters: T tokens, H hidden, N heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5 RMSNorm with zero-centred weight: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``.

    Computed in fp32 and cast back to ``x.dtype``. x: [..., D], w: [D].
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GDN output norm with a plain weight: ``w * rmsnorm(x) * silu(gate)``.

    x, gate: [..., D]; w: [D]. Normalised in fp32, weighted in ``x.dtype``, gated in fp32.
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w * xf.astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape f32[T, rotary_dim] for rotate-half RoPE (pairs (i, i + rotary_dim/2))."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, rotary_dim]
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``rotary_dim`` channels of each head. x: [T, N, D]; cos/sin: [T, rotary_dim]."""
    rd = cos.shape[-1]
    cos = cos.astype(x.dtype)[:, None, :]  # [T, 1, rd]
    sin = sin.astype(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def swiglu_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """Dense SwiGLU: ``down(silu(x @ gate) * (x @ up))``. x: [T, H]; gate_up: [H, 2I]; down: [I, H]."""
    gu = x @ gate_up  # [T, 2I]
    g, u = jnp.split(gu, 2, axis=-1)
    return (jax.nn.silu(g) * u) @ down
