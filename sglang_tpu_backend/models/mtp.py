"""Multi-token prediction (MTP) layers of Qwen3.5 / Qwen3-Next: a one-layer draft model.

Qwen3.5 and Qwen3-Next checkpoints ship ``mtp_num_hidden_layers`` (1) extra decoder layers
under ``mtp.*`` that predict the token after next. For a token row at position p whose target
hidden state ``hidden[p]`` (the target's output after its final norm, as
``qwen3_5_moe.forward_hidden`` returns it and the LM head reads it) and next token ``x[p+1]``
are known, one MTP step computes

    e   = rms_norm(embed_tokens[x[p+1]], pre_fc_norm_embedding)        [T, H]
    h   = rms_norm(hidden[p], pre_fc_norm_hidden)                      [T, H]
    x   = concat([e, h]) @ fc                                          [T, 2H] @ [2H, H]
    x   = x + attention(rms_norm(x, input_layernorm))   at RoPE position p, causal over the
                                                        MTP layer's own KV of positions <= p
    x   = x + moe(rms_norm(x, post_attention_layernorm))   routed top-k + gated shared expert
    out = rms_norm(x, norm)                             the MTP's hidden state
    logits = out @ lm_head.T                            a distribution over x[p+2]

Every RMSNorm is the model's zero-centred one (weight applied as 1 + w). The embedding and
the LM head are the target's (``params``); only fc, the three norms and the decoder layers
are the MTP's own. Step s of a chain of drafts uses MTP layer ``s % mtp_num_hidden_layers``
and feeds ``out`` back as the hidden state of the next step.

MTP params (``loader.load_mtp_params``, shapes in ``param_shapes.mtp_param_shapes``):
    fc [2H, H] (input rows [embedding | hidden]), pre_fc_norm_embedding [H],
    pre_fc_norm_hidden [H], norm [H], layers: tuple of full-attention MoE layer dicts, each
    laid out like one main layer (``models/qwen3_5_moe.py``), not stacked.

KV cache: ``kv_pages`` [mtp_num_hidden_layers, num_pages, 2*G, page_size, D], the layout of
the main cache's attention pages. A request's MTP keys live at the same page ids as its
target keys (one page table for both), so the pool needs no allocator of its own.

Dimension letters: T token rows, R requests, L logits rows, H hidden, V vocab, G kv heads,
D head dim, k draft steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.models.layers import rms_norm, rope_cos_sin
from sglang_tpu_backend.models.qwen3_5_moe import Params, attention_block, compute_logits, moe_block


def init_mtp_cache(cfg: ModelConfig, *, num_pages: int, page_size: int,
                   kv_dtype=jnp.bfloat16) -> jax.Array:
    """Zeroed KV pages of the MTP layers: [mtp_num_hidden_layers, num_pages, 2G, page_size, D]."""
    if not cfg.mtp_num_hidden_layers:
        raise ValueError("the config lists no MTP layer (mtp_num_hidden_layers is 0)")
    shape = (cfg.mtp_num_hidden_layers, num_pages, 2 * cfg.num_key_value_heads, page_size,
             cfg.head_dim)
    return jnp.zeros(shape, kv_dtype)


def mtp_forward(params: Params, mtp_params: Params, cache: jax.Array, batch: ForwardBatch,
                hidden: jax.Array, cfg: ModelConfig, impl: str = "auto", step: int = 0,
                batch_invariant: bool = False, ep=None, tp=None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One MTP step over a ragged batch on one device, or on one DP rank under ``shard_map``
    with ``ep`` (its routed experts split over the ranks on their first axis, as
    ``parallel/dp_forward.py`` places them), or on one TP device with ``tp`` (``cfg`` its
    local config: its share of the attention heads and of the routed experts, laid out like
    the main full-attention layers, ``parallel/tp_forward.py``; the attention output is
    all-reduced like theirs) (module docstring for the math).

    Args:
      params: the target's params (``embed_tokens`` and ``lm_head`` are read).
      mtp_params: the MTP params.
      cache: the MTP KV pages (:func:`init_mtp_cache`); layer ``step % n`` is written at
        ``batch.positions`` through ``batch.page_table``.
      batch: ``input_ids`` i32[T] the NEXT token of each row (x[p+1]), ``positions`` i32[T]
        the row's own position p; the other fields as for the target's step over the same rows.
      hidden: [T, H] the target's hidden state of each row (after its final norm), or the
        previous MTP step's ``out``.
      step: which draft step this is (picks the MTP layer).
    Returns:
      (logits f32[L, V] of the rows ``batch.logits_indices``, out [T, H], cache).
    """
    n = cfg.mtp_num_hidden_layers
    layer = step % n
    p = mtp_params["layers"][layer]
    eps = cfg.rms_norm_eps
    emb = rms_norm(params["embed_tokens"][batch.input_ids], mtp_params["pre_fc_norm_embedding"], eps)
    h = rms_norm(hidden.astype(emb.dtype), mtp_params["pre_fc_norm_hidden"], eps)
    x = jnp.concatenate([emb, h], axis=-1) @ mtp_params["fc"]  # [T, H]
    cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta)
    # The MTP pages are never FP8 (no scales): the MTP layer is not wired to --kv-cache-dtype.
    a, cache, _ = attention_block(p["self_attn"], rms_norm(x, p["input_layernorm"], eps), cache,
                                  None, layer, cos, sin, batch, cfg, impl, batch_invariant)
    if tp is not None:
        a = jax.lax.psum(a, tp.axes)  # the heads' partial sums of o_proj
    x = x + a
    num_valid = batch.cu_q_lens[batch.num_seqs[0]]  # real rows; padding is routed nowhere
    x = x + moe_block(p["mlp"], rms_norm(x, p["post_attention_layernorm"], eps), cfg, impl,
                      ep, tp=tp, num_valid=num_valid)
    out = rms_norm(x, mtp_params["norm"], eps)
    return compute_logits(params, out, batch), out, cache


mtp_forward_jit = jax.jit(mtp_forward, static_argnames=("cfg", "impl", "step", "batch_invariant"),
                          donate_argnames=("cache",))


def draft_chain(params: Params, mtp_params: Params, cache: jax.Array, batch: ForwardBatch,
                hidden: jax.Array, cfg: ModelConfig, num_steps: int, impl: str = "auto"
                ) -> tuple[jax.Array, jax.Array]:
    """Greedy chain drafts: ``num_steps`` MTP steps, each feeding its argmax token and its
    ``out`` hidden state back as the next step's input one position further on.

    ``batch`` is a decode batch (one row per request, ``logits_indices`` = every row): row r
    holds x[p_r+1] at position p_r and ``hidden`` [R, H] the target's hidden state at p_r.
    Step s runs at positions p_r + s with ``kv_lens`` + s, so the page table must cover
    position p_r + num_steps - 1. Returns (drafts i32[R, k]: the guesses for x[p_r+2 ..
    p_r+k+1], the updated MTP cache).
    """
    drafts = []
    for s in range(num_steps):
        logits, hidden, cache = mtp_forward(params, mtp_params, cache, batch, hidden, cfg, impl, s)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R]
        drafts.append(token)
        batch = dataclasses.replace(batch, input_ids=token, positions=batch.positions + 1,
                                    kv_lens=batch.kv_lens + 1, mode=ForwardMode.DECODE)
    return jnp.stack(drafts, axis=1), cache


draft_chain_jit = jax.jit(draft_chain, static_argnames=("cfg", "num_steps", "impl"),
                          donate_argnames=("cache",))
