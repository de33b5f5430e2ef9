"""Qwen3.5-MoE text model in plain JAX: a pure forward over a ragged, paged batch.

Layers follow ``cfg.layer_types``: ``full_attention`` layers run gated GQA attention over a
paged KV cache, ``linear_attention`` layers run Gated DeltaNet with per-request conv and
recurrent state slots; every layer's MLP is a sparse MoE (top-k routed experts plus a
sigmoid-gated shared expert) unless the config marks it dense (Qwen3-Next only).

Dimension letters: T tokens in the step, R requests, L logits rows, H hidden, V vocab,
E experts, K top-k, I expert width, N q heads, G kv heads, D head dim.

Parameter pytree (``loader.load_params`` builds it): nested dicts of arrays; every linear
weight is [in, out] (HF's [out, in] transposed) so layers compute ``x @ w``.

    embed_tokens [V, H], norm [H], lm_head [H, V] (= embed_tokens.T when tied),
    layers: list, one dict per layer with
      input_layernorm [H], post_attention_layernorm [H] (zero-centred, applied as 1 + w)
      self_attn (full_attention layers):
        q_proj [H, N*2*D] (per head [query(D) | gate(D)]), k_proj [H, G*D], v_proj [H, G*D],
        o_proj [N*D, H], q_norm [D], k_norm [D]
      linear_attn (linear_attention layers), C = 2*Hk*Dk + Hv*Dv in order [q | k | v]:
        in_proj_qkv [H, C], in_proj_z [H, Hv*Dv], in_proj_b [H, Hv], in_proj_a [H, Hv],
        conv1d [C, K], A_log f32[Hv], dt_bias f32[Hv], norm [Dv] (plain weight),
        out_proj [Hv*Dv, H]
      mlp (MoE): gate [H, E]; experts {gate_up [E, H, 2I] (columns [gate | up]), down [E, I, H],
        and with FP8 experts kept: gate_up_scale f32[E, H/128, 2I/128], down_scale
        f32[E, I/128, H/128] (128x128 block scales, multiply to dequantise)};
        shared_expert {gate_up [H, 2Is], down [Is, H]}; shared_expert_gate [H, 1]
      mlp (dense, Qwen3-Next mlp_only layers): gate_up [H, 2I], down [I, H]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kernels import gdn, gmm, ragged_paged_attention as rpa, routing
from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.models.layers import (
    apply_partial_rope,
    gated_rms_norm,
    rms_norm,
    rope_cos_sin,
    swiglu_mlp,
)

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """Per-layer device state that persists across steps.

    k_pages, v_pages: one [num_pages, page_size, G, D] array per attention layer.
    conv_state:       one [num_slots, C, conv_kernel - 1] array per GDN layer.
    rec_state:        one [num_slots, Hv, Dk, Dv] array per GDN layer.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    conv_state: tuple[jax.Array, ...]
    rec_state: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0] if self.k_pages else 0

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1] if self.k_pages else 0


def init_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    num_state_slots: int,
    kv_dtype=jnp.bfloat16,
    state_dtype=jnp.float32,
    conv_dtype=None,
) -> ModelCache:
    """Zeroed KV pages and GDN state slots. Every page and slot id is usable."""
    conv_dtype = kv_dtype if conv_dtype is None else conv_dtype
    kv_shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    conv_shape = (num_state_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1)
    rec_shape = (
        num_state_slots,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    return ModelCache(
        k_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(n_attn)),
        v_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(n_attn)),
        conv_state=tuple(jnp.zeros(conv_shape, conv_dtype) for _ in range(n_lin)),
        rec_state=tuple(jnp.zeros(rec_shape, state_dtype) for _ in range(n_lin)),
    )


def attention_block(p: Params, x, k_pages, v_pages, cos, sin, batch: ForwardBatch, cfg, impl):
    """Gated GQA attention. x: [T, H] -> ([T, H], k_pages, v_pages)."""
    T = x.shape[0]
    N, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_gate = (x @ p["q_proj"]).reshape(T, N, 2 * D)  # per head [query | gate]
    q, gate = q_gate[..., :D], q_gate[..., D:]  # [T, N, D] each
    k = (x @ p["k_proj"]).reshape(T, G, D)
    v = (x @ p["v_proj"]).reshape(T, G, D)
    q = apply_partial_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = apply_partial_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), cos, sin)
    o, k_pages, v_pages = rpa.ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        batch.kv_lens,
        batch.page_table,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=D**-0.5,
        new_k=k.astype(k_pages.dtype),
        new_v=v.astype(v_pages.dtype),
        impl=impl,
    )  # o: [T, N, D]
    o = o.reshape(T, N * D) * jax.nn.sigmoid(gate.reshape(T, N * D))
    return o @ p["o_proj"], k_pages, v_pages


def gdn_block(p: Params, x, conv_state, rec_state, batch: ForwardBatch, cfg, impl):
    """Gated DeltaNet. x: [T, H] -> ([T, H], conv_state, rec_state)."""
    T = x.shape[0]
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed_qkv = x @ p["in_proj_qkv"]  # [T, C]
    z = (x @ p["in_proj_z"]).reshape(T, Hv, Dv)
    b = x @ p["in_proj_b"]  # [T, Hv]
    a = x @ p["in_proj_a"]  # [T, Hv]
    o, conv_state, rec_state = gdn.gated_delta_net(
        mixed_qkv,
        a,
        b,
        p["conv1d"],
        p["A_log"],
        p["dt_bias"],
        conv_state,
        rec_state,
        batch.cu_q_lens,
        batch.kv_lens,
        batch.state_slots,
        batch.num_seqs,
        num_k_heads=cfg.linear_num_key_heads,
        decode=batch.mode.is_decode(),
        impl=impl,
    )  # o: [T, Hv, Dv]
    o = gated_rms_norm(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps).reshape(T, Hv * Dv)
    return o @ p["out_proj"], conv_state, rec_state


def moe_block(p: Params, x, cfg: ModelConfig, impl):
    """Sparse MoE with renormalised top-k and a sigmoid-gated shared expert. x: [T, H]."""
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    router_logits = x @ p["gate"]  # [T, E]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    top_w, top_i = jax.lax.top_k(probs, K)  # [T, K]
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(x.dtype).astype(jnp.float32)

    experts = p["experts"]
    token_idx, group_sizes, rows = routing.route_metadata(top_i.astype(jnp.int32), E)
    xs = routing.gather_rows(x, token_idx, impl=impl)  # [T*K, H] sorted by expert
    h = gmm.gmm_swiglu(
        xs, experts["gate_up"], group_sizes, rhs_scale=experts.get("gate_up_scale"),
        out_dtype=x.dtype, impl=impl,
    )  # [T*K, I]
    y = gmm.gmm(
        h, experts["down"], group_sizes, rhs_scale=experts.get("down_scale"),
        out_dtype=x.dtype, impl=impl,
    )  # [T*K, H]
    routed = routing.gather_reduce(y, rows, top_w, impl=impl)  # [T, H]

    shared = p["shared_expert"]
    shared_out = swiglu_mlp(x, shared["gate_up"], shared["down"])  # [T, H]
    shared_out = jax.nn.sigmoid(x @ p["shared_expert_gate"]) * shared_out
    return routed + shared_out


def mlp_block(p: Params, x, cfg: ModelConfig, layer: int, impl):
    if cfg.is_moe_layer(layer):
        return moe_block(p, x, cfg, impl)
    return swiglu_mlp(x, p["gate_up"], p["down"])


def forward_hidden(params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig, impl):
    """All decoder layers and the final norm. Returns (hidden [T, H], cache)."""
    x = params["embed_tokens"][batch.input_ids]  # [T, H]
    cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta)
    k_pages, v_pages = list(cache.k_pages), list(cache.v_pages)
    conv_state, rec_state = list(cache.conv_state), list(cache.rec_state)
    i_attn = i_lin = 0
    for layer, (p, kind) in enumerate(zip(params["layers"], cfg.layer_types)):
        h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
        if kind == FULL_ATTENTION:
            h, k_pages[i_attn], v_pages[i_attn] = attention_block(
                p["self_attn"], h, k_pages[i_attn], v_pages[i_attn], cos, sin, batch, cfg, impl
            )
            i_attn += 1
        else:
            h, conv_state[i_lin], rec_state[i_lin] = gdn_block(
                p["linear_attn"], h, conv_state[i_lin], rec_state[i_lin], batch, cfg, impl
            )
            i_lin += 1
        x = x + h
        h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
        x = x + mlp_block(p["mlp"], h, cfg, layer, impl)
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    new_cache = ModelCache(tuple(k_pages), tuple(v_pages), tuple(conv_state), tuple(rec_state))
    return x, new_cache


def forward(
    params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig, impl: str = "auto"
) -> tuple[jax.Array, ModelCache]:
    """One model step over a ragged batch.

    Returns f32[L, V] logits for the rows ``batch.logits_indices`` and the updated cache.
    Jit with ``static_argnames=("cfg", "impl")`` and ``donate_argnames=("cache",)``.
    """
    hidden, cache = forward_hidden(params, cache, batch, cfg, impl)
    h = hidden[batch.logits_indices]  # [L, H]
    logits = (h @ params["lm_head"]).astype(jnp.float32)  # [L, V]
    return logits, cache


forward_jit = jax.jit(forward, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
