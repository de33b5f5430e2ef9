"""The router's top-k of every token of a sequence, recomputed layer by layer (no scan, no
router-stats plumbing): what ``meta_info["routed_experts"]`` must hold."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import FULL_ATTENTION
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.models import qwen3_5_moe as m
from sglang_tpu_backend.models.layers import rms_norm, rope_cos_sin


PAD = 128  # every sequence padded to this many rows: one compiled reference


def reference_routed(params, cfg, token_ids: list[int], page_size: int = 16) -> np.ndarray:
    """i32[len(token_ids), num_moe_layers, K]: each MoE layer's router top-k (logical ids) of
    every token, the sequence run as one prefill on a fresh cache with one layer at a time
    (padded to ``PAD`` rows; the padding comes after every real row, so it changes nothing)."""
    n = len(token_ids)
    assert n <= PAD and PAD % page_size == 0
    num_pages = PAD // page_size
    fb, _ = build_forward_batch([SeqChunk(token_ids, 0, list(range(num_pages)), 0)],
                                page_size=page_size, num_tokens=PAD, num_seqs=1,
                                pages_per_seq=num_pages, num_logits=1)
    out = _routed(params, jax.tree.map(jnp.asarray, fb), cfg=cfg, page_size=page_size)
    return np.asarray(out)[:n].astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "page_size"))
def _routed(params, fb, *, cfg, page_size: int):
    cache = m.init_cache(cfg, num_pages=PAD // page_size, page_size=page_size,
                         num_state_slots=1, kv_dtype=jnp.float32)
    cos, sin = rope_cos_sin(fb.positions, cfg.rotary_dim, cfg.rope_theta)
    kv, kv_scales, conv, rec = cache.kv_pages, cache.kv_scales, cache.conv_state, cache.rec_state
    num_valid = fb.cu_q_lens[fb.num_seqs[0]]
    x = params["embed_tokens"][fb.input_ids]
    period, kinds = cfg.layer_period, cfg.layer_types
    n_attn = n_lin = 0
    out = []
    for layer in range(cfg.num_hidden_layers):
        g, j = divmod(layer, period)
        p = jax.tree.map(lambda a: a[g], params["layer_groups"][j])
        h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
        if kinds[layer] == FULL_ATTENTION:
            h, kv, kv_scales = m.attention_block(p["self_attn"], h, kv, kv_scales, n_attn, cos,
                                                 sin, fb, cfg, "xla")
            n_attn += 1
        else:
            h, conv, rec, _ = m.gdn_block(p["linear_attn"], h, conv, rec, n_lin, fb, cfg, "xla")
            n_lin += 1
        x = x + h
        h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
        if cfg.is_moe_layer(j):
            probs = jax.nn.softmax((h @ p["mlp"]["gate"]).astype(jnp.float32), axis=-1)
            out.append(jax.lax.top_k(probs, cfg.num_experts_per_tok)[1])
        x = x + m.mlp_block(p["mlp"], h, cfg, j, "xla", num_valid=num_valid)
    return jnp.stack(out, axis=1)  # [PAD, M, K]
