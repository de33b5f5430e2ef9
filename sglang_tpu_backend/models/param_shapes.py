"""Shapes and dtypes of the parameter pytree, without any data.

``param_shapes(cfg)`` is the abstract twin of ``loader.load_params(dir, cfg)``: the same tree
(layout in ``models/qwen3_5_moe.py``) with ``jax.ShapeDtypeStruct`` leaves. It lets a step be
compiled for a 397B model on a machine that holds none of its weights (``kernels/tpu_compile``)
and lets memory be planned from a config alone.

Letters: H hidden, V vocab, E experts, I expert width, Is shared-expert width, N/G q/kv heads of
size D, Hv value heads of size Dv, C conv channels, K conv taps, P = layer_period.

``num_physical_experts`` (EPLB, ``model_executor/expert_location.py``): the routed experts
stored in that many physical slots per layer (E + redundant), with the layer's
``expert_location`` map (physical i32[E, C], copies i32[E], logical i32[slots]).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig

FP8_BLOCK = 128  # block size of FP8 expert scales (the checkpoints' weight_scale_inv)


def _sd(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


def layer_param_shapes(cfg: ModelConfig, layer: int, dtype: Any = jnp.bfloat16,
                       fp8_experts: bool = False, num_physical_experts: int | None = None
                       ) -> dict:
    """One layer's param dict as ShapeDtypeStructs (what the loader builds for ``layer``)."""
    return decoder_layer_shapes(cfg, cfg.layer_types[layer], cfg.is_moe_layer(layer), dtype,
                                fp8_experts, num_physical_experts)


def decoder_layer_shapes(cfg: ModelConfig, kind: str, moe: bool, dtype: Any = jnp.bfloat16,
                         fp8_experts: bool = False, num_physical_experts: int | None = None
                         ) -> dict:
    """The param dict of a decoder layer whose token mixer is ``kind`` (FULL_ATTENTION or
    LINEAR_ATTENTION) and whose MLP is a MoE (``moe``) or dense."""
    H = cfg.hidden_size
    out: dict[str, Any] = {"input_layernorm": _sd((H,), dtype),
                           "post_attention_layernorm": _sd((H,), dtype)}
    if kind == FULL_ATTENTION:
        N, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out["self_attn"] = {
            "q_proj": _sd((H, N * 2 * D), dtype), "k_proj": _sd((H, G * D), dtype),
            "v_proj": _sd((H, G * D), dtype), "o_proj": _sd((N * D, H), dtype),
            "q_norm": _sd((D,), dtype), "k_norm": _sd((D,), dtype),
        }
    else:
        Hv, Dv, C = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
        out["linear_attn"] = {
            "in_proj_qkv": _sd((H, C), dtype), "in_proj_z": _sd((H, Hv * Dv), dtype),
            "in_proj_b": _sd((H, Hv), dtype), "in_proj_a": _sd((H, Hv), dtype),
            "conv1d": _sd((C, cfg.linear_conv_kernel_dim), dtype),
            "A_log": _sd((Hv,), jnp.float32), "dt_bias": _sd((Hv,), jnp.float32),
            "norm": _sd((Dv,), dtype), "out_proj": _sd((Hv * Dv, H), dtype),
        }
    if not moe:
        Id = cfg.intermediate_size
        out["mlp"] = {"gate_up": _sd((H, 2 * Id), dtype), "down": _sd((Id, H), dtype)}
        return out
    I = cfg.moe_intermediate_size
    E = cfg.num_experts if num_physical_experts is None else num_physical_experts
    # Routed experts in the checkpoint's [out, in] layout (the grouped matmul contracts their
    # last axis): loaded as stored, never transposed.
    if fp8_experts and I % FP8_BLOCK == 0:  # the loader dequantises other widths
        bh, bi = -(-H // FP8_BLOCK), I // FP8_BLOCK
        experts = {"gate_up": _sd((E, 2 * I, H), jnp.float8_e4m3fn),
                   "down": _sd((E, H, I), jnp.float8_e4m3fn),
                   "gate_up_scale": _sd((E, 2 * bi, bh), jnp.float32),
                   "down_scale": _sd((E, bh, bi), jnp.float32)}
    else:
        experts = {"gate_up": _sd((E, 2 * I, H), dtype), "down": _sd((E, H, I), dtype)}
    mlp: dict[str, Any] = {"gate": _sd((H, cfg.num_experts), dtype), "experts": experts}
    if num_physical_experts is not None:
        C = num_physical_experts - cfg.num_experts + 1
        mlp["expert_location"] = {"physical": _sd((cfg.num_experts, C), jnp.int32),
                                  "copies": _sd((cfg.num_experts,), jnp.int32),
                                  "logical": _sd((num_physical_experts,), jnp.int32)}
    if cfg.shared_expert_intermediate_size:
        Is = cfg.shared_expert_intermediate_size
        mlp["shared_expert"] = {"gate_up": _sd((H, 2 * Is), dtype), "down": _sd((Is, H), dtype)}
        mlp["shared_expert_gate"] = _sd((H, 1), dtype)
    out["mlp"] = mlp
    return out


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.bfloat16, fp8_experts: bool = False,
                 num_physical_experts: int | None = None) -> dict:
    """The whole param pytree (layer groups stacked) as ShapeDtypeStructs."""
    P = cfg.layer_period
    num_groups = cfg.num_hidden_layers // P
    stack = lambda s: _sd((num_groups, *s.shape), s.dtype)  # noqa: E731
    groups = tuple(jax.tree.map(stack, layer_param_shapes(cfg, j, dtype, fp8_experts,
                                                          num_physical_experts))
                   for j in range(P))
    V, H = cfg.vocab_size, cfg.hidden_size
    return {"embed_tokens": _sd((V, H), dtype), "layer_groups": groups,
            "norm": _sd((H,), dtype), "lm_head": _sd((V, H), dtype)}


def mtp_param_shapes(cfg: ModelConfig, dtype: Any = jnp.bfloat16, fp8_experts: bool = False
                     ) -> dict | None:
    """The MTP params (``models/mtp.py``) as ShapeDtypeStructs, None without MTP layers:
    fc [2H, H] (input rows [embedding | hidden]), pre_fc_norm_embedding [H],
    pre_fc_norm_hidden [H], norm [H], and ``layers``: a tuple of ``mtp_num_hidden_layers``
    full-attention MoE layer dicts (layout of one decoder layer, unstacked). The embedding
    and the LM head are the main model's."""
    if not cfg.mtp_num_hidden_layers:
        return None
    H = cfg.hidden_size
    layer = decoder_layer_shapes(cfg, FULL_ATTENTION, True, dtype, fp8_experts)
    return {"fc": _sd((2 * H, H), dtype), "pre_fc_norm_embedding": _sd((H,), dtype),
            "pre_fc_norm_hidden": _sd((H,), dtype), "norm": _sd((H,), dtype),
            "layers": tuple(layer for _ in range(cfg.mtp_num_hidden_layers))}


def num_param_bytes(shapes) -> int:
    """Total bytes of a pytree of ShapeDtypeStructs (or arrays)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))
