"""Safetensors checkpoint -> parameter pytree (layout in ``models/qwen3_5_moe.py``).

Reads HF Qwen3.5-MoE (``model.language_model.`` / ``model.`` prefixes) and Qwen3-Next
checkpoints, fused or per-expert expert layouts, bf16/fp32/FP8-block-scaled weights. Every
expected tensor's name and shape is checked from the file headers before any data is read;
then tensors stream one at a time: read, dequantise, transpose to [in, out], cast, place.

Letters: H hidden, V vocab, E experts, I expert width, Is shared-expert width, Hq/Hkv attention
heads of size D, Hk/Hv GDN key/value heads of sizes Dk/Dv, C = 2*Hk*Dk + Hv*Dv, K conv kernel.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from sglang_tpu_backend.checkpoint_io import (
    FP8_BLOCK,
    CheckpointError,
    TensorEntry,
    index_checkpoint,
    read_tensor,
)
from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig, load_model_config
from sglang_tpu_backend.models.qwen3_5_moe import stack_layers

__all__ = ["CheckpointError", "load_model", "load_params"]

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("visual.", "model.visual.", "mtp.", "model.mtp.")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_F8_CODES = ("F8_E4M3", "F8_E5M2")
Shape = tuple[int, ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Expected tensors ------------------------------------------------------------------------
def _attn_shapes(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{p}q_proj.weight": (hq * 2 * d, h),
        f"{p}k_proj.weight": (hkv * d, h),
        f"{p}v_proj.weight": (hkv * d, h),
        f"{p}o_proj.weight": (h, hq * d),
        f"{p}q_norm.weight": (d,),
        f"{p}k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c = cfg.linear_conv_dim
    shapes: dict[str, Shape] = {}
    if cfg.model_type == "qwen3_next":
        shapes[f"{p}in_proj_qkvz.weight"] = (c + hv * dv, h)
        shapes[f"{p}in_proj_ba.weight"] = (2 * hv, h)
    else:
        shapes[f"{p}in_proj_qkv.weight"] = (c, h)
        shapes[f"{p}in_proj_z.weight"] = (hv * dv, h)
        shapes[f"{p}in_proj_b.weight"] = (hv, h)
        shapes[f"{p}in_proj_a.weight"] = (hv, h)
    shapes.update({
        f"{p}conv1d.weight": (c, 1, cfg.linear_conv_kernel_dim),
        f"{p}A_log": (hv,),
        f"{p}dt_bias": (hv,),
        f"{p}norm.weight": (dv,),
        f"{p}out_proj.weight": (h, hv * dv),
    })
    return shapes


def _mlp_shapes(cfg: ModelConfig, layer: int, p: str, fused: bool) -> dict[str, Shape]:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        return {f"{p}gate_proj.weight": (i, h), f"{p}up_proj.weight": (i, h), f"{p}down_proj.weight": (h, i)}
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes: dict[str, Shape] = {f"{p}gate.weight": (e, h)}
    if fused:
        shapes[f"{p}experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[f"{p}experts.down_proj"] = (e, h, i)
    else:
        for x in range(e):
            shapes[f"{p}experts.{x}.gate_proj.weight"] = (i, h)
            shapes[f"{p}experts.{x}.up_proj.weight"] = (i, h)
            shapes[f"{p}experts.{x}.down_proj.weight"] = (h, i)
    if s:
        shapes.update({
            f"{p}shared_expert.gate_proj.weight": (s, h),
            f"{p}shared_expert.up_proj.weight": (s, h),
            f"{p}shared_expert.down_proj.weight": (h, s),
            f"{p}shared_expert_gate.weight": (1, h),
        })
    return shapes


def _expected_shapes(cfg: ModelConfig, prefix: str, entries: dict[str, TensorEntry]) -> dict[str, Shape]:
    """Every HF tensor name the model needs (FP8 scales included) -> expected shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, Shape] = {f"{prefix}embed_tokens.weight": (v, h), f"{prefix}norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{prefix}layers.{i}."
        shapes[f"{lp}input_layernorm.weight"] = (h,)
        shapes[f"{lp}post_attention_layernorm.weight"] = (h,)
        if kind == FULL_ATTENTION:
            shapes.update(_attn_shapes(cfg, f"{lp}self_attn."))
        else:
            shapes.update(_gdn_shapes(cfg, f"{lp}linear_attn."))
        fused = f"{lp}mlp.experts.gate_up_proj" in entries
        shapes.update(_mlp_shapes(cfg, i, f"{lp}mlp.", fused))
    for name, shape in list(shapes.items()):
        e = entries.get(name)
        if e is None or e.dtype not in _F8_CODES:
            continue
        if not name.endswith(".weight") or len(shape) != 2:
            raise CheckpointError(f"tensor {name} is {e.dtype} but only 2-D '*.weight' tensors may be FP8")
        shapes[name + "_scale_inv"] = (_cdiv(shape[0], FP8_BLOCK), _cdiv(shape[1], FP8_BLOCK))
    return shapes


def _check_entries(checkpoint_dir: Path, expected: dict[str, Shape], entries: dict[str, TensorEntry]) -> None:
    missing = [f"{n} (expected shape {list(s)})" for n, s in expected.items() if n not in entries]
    wrong = [
        f"{n} expected shape {list(s)}, got {list(entries[n].shape)}"
        for n, s in expected.items()
        if n in entries and tuple(entries[n].shape) != s
    ]

    def few(items: list[str]) -> str:
        more = f"; ... and {len(items) - 5} more" if len(items) > 5 else ""
        return "; ".join(items[:5]) + more

    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_dir} lacks {len(missing)} tensor(s): {few(missing)}")
    if wrong:
        raise CheckpointError(f"checkpoint {checkpoint_dir} has {len(wrong)} tensor(s) of wrong shape: {few(wrong)}")


# Reading and converting ------------------------------------------------------------------
class _Reader:
    """Reads named tensors once each, dequantises FP8 pairs, casts and places them."""

    def __init__(self, entries: dict[str, TensorEntry], dtype: Any, bar: tqdm):
        self.entries = entries
        self.np_dtype = np.dtype(dtype)
        self.used: set[str] = set()
        self.bar = bar

    def raw(self, name: str) -> np.ndarray:
        self.used.add(name)
        self.bar.update(1)
        return read_tensor(self.entries[name])

    def is_fp8(self, name: str) -> bool:
        return self.entries[name].dtype in _F8_CODES

    def hf(self, name: str) -> np.ndarray:
        """HF-layout tensor, dequantised (to f32) when it is FP8 block-scaled."""
        t = self.raw(name)
        if self.is_fp8(name):
            t = dequantize_blocks(t, self.raw(name + "_scale_inv"))
        return t

    def cast(self, a: np.ndarray) -> jnp.ndarray:
        return jnp.asarray(np.ascontiguousarray(a, dtype=self.np_dtype))

    def vec(self, name: str) -> jnp.ndarray:
        return self.cast(self.raw(name))

    def f32(self, name: str) -> jnp.ndarray:
        return jnp.asarray(self.raw(name).astype(np.float32))

    def linear(self, name: str) -> jnp.ndarray:
        """HF [out, in] weight -> [in, out]."""
        return self.cast(self.hf(name).T)

    def gate_up(self, gate: str, up: str) -> jnp.ndarray:
        """Two HF [I, H] weights -> [H, 2I] with columns [gate | up]."""
        return self.cast(np.concatenate([self.hf(gate).T, self.hf(up).T], axis=1))


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """f32 ``q * scale_inv`` with each scale covering a FP8_BLOCK x FP8_BLOCK tile of the last 2 dims."""
    rows, cols = q.shape[-2:]
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, -2), FP8_BLOCK, -1)
    return q.astype(np.float32) * s[..., :rows, :cols]


def _load_attn(r: _Reader, p: str) -> dict:
    return {
        "q_proj": r.linear(f"{p}q_proj.weight"),
        "k_proj": r.linear(f"{p}k_proj.weight"),
        "v_proj": r.linear(f"{p}v_proj.weight"),
        "o_proj": r.linear(f"{p}o_proj.weight"),
        "q_norm": r.vec(f"{p}q_norm.weight"),
        "k_norm": r.vec(f"{p}k_norm.weight"),
    }


def split_qkvz_ba(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next fused projections (HF [out, H], interleaved per key-head group) ->
    HF-layout ``in_proj_qkv`` ([q|k|v] rows), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

    qkvz rows are Hk groups of [q(Dk) | k(Dk) | v(r*Dv) | z(r*Dv)] with r = Hv / Hk; ba rows
    are Hk groups of [b(r) | a(r)]. Value head j of group g is head g*r + j.
    """
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r = hv // hk
    h = qkvz.shape[-1]
    g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, h)
    q, k = g[:, :dk], g[:, dk : 2 * dk]
    v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
    gba = ba.reshape(hk, 2 * r, h)
    return {
        "in_proj_qkv": np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]),
        "in_proj_z": z.reshape(hv * dv, h),
        "in_proj_b": gba[:, :r].reshape(hv, h),
        "in_proj_a": gba[:, r:].reshape(hv, h),
    }


def _load_gdn(r: _Reader, cfg: ModelConfig, p: str) -> dict:
    if cfg.model_type == "qwen3_next":
        parts = split_qkvz_ba(cfg, r.hf(f"{p}in_proj_qkvz.weight"), r.hf(f"{p}in_proj_ba.weight"))
        proj = {k: r.cast(v.T) for k, v in parts.items()}
    else:
        proj = {k: r.linear(f"{p}{k}.weight") for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    return {
        **proj,
        "conv1d": r.cast(r.raw(f"{p}conv1d.weight")[:, 0, :]),
        "A_log": r.f32(f"{p}A_log"),
        "dt_bias": r.f32(f"{p}dt_bias"),
        "norm": r.vec(f"{p}norm.weight"),
        "out_proj": r.linear(f"{p}out_proj.weight"),
    }


def _load_experts(r: _Reader, cfg: ModelConfig, p: str, keep_fp8: bool) -> dict:
    """Routed experts -> gate_up [E, H, 2I], down [E, I, H] (+ block scales when kept FP8)."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if f"{p}gate_up_proj" in r.entries:  # fused [E, 2I, H] / [E, H, I]
        gate_up = r.hf(f"{p}gate_up_proj").transpose(0, 2, 1)
        down = r.hf(f"{p}down_proj").transpose(0, 2, 1)
        return {"gate_up": r.cast(gate_up), "down": r.cast(down)}
    names = [(f"{p}{x}.gate_proj.weight", f"{p}{x}.up_proj.weight", f"{p}{x}.down_proj.weight") for x in range(e)]
    fp8 = r.is_fp8(names[0][0])
    if keep_fp8 and fp8 and i % FP8_BLOCK == 0:
        return _load_experts_fp8(r, cfg, names)
    if keep_fp8 and not fp8:
        log.info("keep_fp8_experts: experts in %s are not FP8; loading them as %s", p, r.np_dtype)
    elif keep_fp8 and fp8:
        log.info("keep_fp8_experts: expert width %d is not a multiple of %d; dequantising %s", i, FP8_BLOCK, p)
    gate_up = np.empty((e, h, 2 * i), r.np_dtype)  # [E, H, 2I] host buffer filled expert by expert
    down = np.empty((e, i, h), r.np_dtype)  # [E, I, H]
    for x, (g, u, d) in enumerate(names):
        gate_up[x, :, :i] = r.hf(g).T
        gate_up[x, :, i:] = r.hf(u).T
        down[x] = r.hf(d).T
    return {"gate_up": jnp.asarray(gate_up), "down": jnp.asarray(down)}


def _load_experts_fp8(r: _Reader, cfg: ModelConfig, names: list[tuple[str, str, str]]) -> dict:
    """FP8 experts kept as stored values: block scales transposed along with the weights."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    bh, bi = _cdiv(h, FP8_BLOCK), i // FP8_BLOCK
    gate_up = np.empty((e, h, 2 * i), _FP8)  # fp8[E, H, 2I]
    gate_up_scale = np.empty((e, bh, 2 * bi), np.float32)  # f32[E, H/128, 2I/128]
    down = np.empty((e, i, h), _FP8)  # fp8[E, I, H]
    down_scale = np.empty((e, bi, bh), np.float32)  # f32[E, I/128, H/128]
    for x, (g, u, d) in enumerate(names):
        for col, name in ((slice(0, i), g), (slice(i, 2 * i), u)):
            gate_up[x, :, col] = r.raw(name).astype(_FP8).T
        gate_up_scale[x, :, :bi] = r.raw(g + "_scale_inv").T
        gate_up_scale[x, :, bi:] = r.raw(u + "_scale_inv").T
        down[x] = r.raw(d).astype(_FP8).T
        down_scale[x] = r.raw(d + "_scale_inv").T
    return {
        "gate_up": jnp.asarray(gate_up),
        "down": jnp.asarray(down),
        "gate_up_scale": jnp.asarray(gate_up_scale),
        "down_scale": jnp.asarray(down_scale),
    }


def _load_mlp(r: _Reader, cfg: ModelConfig, layer: int, p: str, keep_fp8: bool) -> dict:
    if not cfg.is_moe_layer(layer):
        return {"gate_up": r.gate_up(f"{p}gate_proj.weight", f"{p}up_proj.weight"),
                "down": r.linear(f"{p}down_proj.weight")}
    mlp = {"gate": r.linear(f"{p}gate.weight"), "experts": _load_experts(r, cfg, f"{p}experts.", keep_fp8)}
    if cfg.shared_expert_intermediate_size:
        s = f"{p}shared_expert."
        mlp["shared_expert"] = {"gate_up": r.gate_up(f"{s}gate_proj.weight", f"{s}up_proj.weight"),
                                "down": r.linear(f"{s}down_proj.weight")}
        mlp["shared_expert_gate"] = r.linear(f"{p}shared_expert_gate.weight")
    return mlp


def _detect_prefix(entries: dict[str, TensorEntry]) -> str:
    if any(n.startswith("model.language_model.") for n in entries):
        return "model.language_model."
    return "model."


def _report_leftovers(entries: dict[str, TensorEntry], used: set[str], cfg: ModelConfig) -> None:
    left = [n for n in entries if n not in used]
    skipped = [n for n in left if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("skipped %d vision/MTP tensors (visual.*, mtp.*)", len(skipped))
    unknown = [n for n in left if not n.startswith(SKIPPED_PREFIXES)
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unknown:
        more = f", ... ({len(unknown)} in all)" if len(unknown) > 5 else ""
        log.warning("ignored %d unexpected checkpoint tensors: %s%s", len(unknown), ", ".join(unknown[:5]), more)


def load_params(
    checkpoint_dir: str | Path,
    cfg: ModelConfig,
    *,
    dtype: Any = jnp.bfloat16,
    keep_fp8_experts: bool = False,
    progress: bool | None = None,
    backend: str | None = None,
) -> dict:
    """Load a safetensors checkpoint into the params pytree (layout in ``models/qwen3_5_moe.py``).

    Args:
      checkpoint_dir: directory with ``*.safetensors`` (and optionally the index json).
      cfg: the model's config (``load_model_config(checkpoint_dir)``).
      dtype: dtype of every parameter except ``A_log``/``dt_bias`` (f32) and kept FP8 experts.
      keep_fp8_experts: keep FP8 routed experts as float8_e4m3fn plus block scales for the
        TPU kernels (needs ``moe_intermediate_size % 128 == 0``; otherwise they are
        dequantised, with a log line). Off-TPU it is ignored (log line): the experts are
        dequantised here, once, instead of on every grouped matmul of every step.
      progress: show a tqdm bar (None: only on a terminal).
      backend: the JAX backend the params are for (None: ``jax.default_backend()``); FP8
        experts are kept only for ``"tpu"``.

    Off-TPU the dequantised experts are ``fp8 * scale`` in f32, exactly the weights the FP8
    grouped-matmul reference computes with, then cast to ``dtype``: identical for f32, one
    bf16 rounding (relative error <= 2^-9 per weight) for bf16.

    Raises:
      CheckpointError: pickle-only directory, missing tensors or wrong shapes (named by HF name).
    """
    backend = backend or jax.default_backend()
    if keep_fp8_experts and backend != "tpu":
        log.info("keep_fp8_experts: backend %s has no FP8 expert kernels; dequantising FP8 "
                 "experts once at load", backend)
        keep_fp8_experts = False
    checkpoint_dir = Path(checkpoint_dir)
    entries = index_checkpoint(checkpoint_dir)
    prefix = _detect_prefix(entries)
    expected = _expected_shapes(cfg, prefix, entries)
    _check_entries(checkpoint_dir, expected, entries)
    disable = None if progress is None else not progress
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=disable) as bar:
        r = _Reader(entries, dtype, bar)
        params: dict[str, Any] = {"embed_tokens": r.vec(f"{prefix}embed_tokens.weight")}
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            lp = f"{prefix}layers.{i}."
            layer = {"input_layernorm": r.vec(f"{lp}input_layernorm.weight"),
                     "post_attention_layernorm": r.vec(f"{lp}post_attention_layernorm.weight")}
            if kind == FULL_ATTENTION:
                layer["self_attn"] = _load_attn(r, f"{lp}self_attn.")
            else:
                layer["linear_attn"] = _load_gdn(r, cfg, f"{lp}linear_attn.")
            layer["mlp"] = _load_mlp(r, cfg, i, f"{lp}mlp.", keep_fp8_experts)
            layers.append(layer)
        params["layer_groups"] = stack_layers(layers, cfg)
        params["norm"] = r.vec(f"{prefix}norm.weight")
        if cfg.tie_word_embeddings:
            params["lm_head"] = params["embed_tokens"].T
        else:
            params["lm_head"] = r.linear("lm_head.weight")
    _report_leftovers(entries, r.used, cfg)
    return params


def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    keep_fp8_experts: bool = False,
    progress: bool | None = None,
    backend: str | None = None,
) -> tuple[ModelConfig, dict]:
    """``(load_model_config(dir), load_params(dir, cfg, ...))``; raises ConfigError/CheckpointError."""
    cfg = load_model_config(checkpoint_dir)
    return cfg, load_params(checkpoint_dir, cfg, dtype=dtype, keep_fp8_experts=keep_fp8_experts,
                            progress=progress, backend=backend)
