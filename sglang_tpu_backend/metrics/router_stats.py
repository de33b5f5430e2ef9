"""In-step router health: a few reductions per MoE layer, cheap enough to leave on.

Dimension letters: T token rows of the step (bucketed; rows past the real token count are
padding and masked out), E routed experts, K experts per token.

``router_stats(router_logits, top_i, num_valid)`` returns f32[3] per layer:
  0. max / mean tokens per expert (1 = perfectly balanced; E / K when every token picks the
     same K experts); NaN when the step has no real tokens;
  1. mean router softmax entropy over real tokens (nats; ln E = uniform router);
  2. mean top-1 router probability over real tokens.
It costs one [T, E] softmax-entropy pass and a scatter-add of T*K ones into [E] counters; the
router's logits and top-k ids are already computed by the MoE block.

``slot_counts(slot_i, num_valid, num_slots)`` returns f32[P]: the real rows routed to each
physical expert slot (P = E without an expert location), what EPLB records
(``parallel/eplb.py``) and what the per-EP-rank routed-row max/mean is computed from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_STATS = 3  # (load max/mean, entropy, top-1 probability)
# The step's ``with_stats`` value that also returns the routed LOGICAL expert ids per token
# (``--enable-return-routed-experts``; ``qwen3_5_moe.forward``, ``model_executor/routed_experts.py``);
# truthy, so every ``if with_stats`` path computes the router stats as well.
ROUTED = "routed"


def router_stats(router_logits, top_i, num_valid):
    """router_logits f32[T, E], top_i i32[T, K], num_valid i32[] -> f32[3]."""
    T, E = router_logits.shape
    K = top_i.shape[1]
    valid = jnp.arange(T) < num_valid  # bool[T]
    logp = jax.nn.log_softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    p = jnp.exp(logp)
    entropy = -jnp.sum(p * logp, axis=-1)  # [T]
    top1 = jnp.max(p, axis=-1)  # [T]
    ids = jnp.where(valid[:, None], top_i, E).reshape(-1)  # padding rows -> dropped bin E
    counts = jnp.zeros((E + 1,), jnp.float32).at[ids].add(1.0)[:E]  # [E]
    n = num_valid.astype(jnp.float32)
    mean_load = n * K / E
    ratio = jnp.where(n > 0, jnp.max(counts) / jnp.maximum(mean_load, 1e-9), jnp.nan)
    mean = lambda v: jnp.sum(jnp.where(valid, v, 0.0)) / jnp.maximum(n, 1.0)  # noqa: E731
    return jnp.stack([ratio, mean(entropy), mean(top1)])  # f32[3]


def slot_counts(slot_i, num_valid, num_slots: int):
    """slot_i i32[T, K] physical slot ids, num_valid i32[] -> f32[num_slots] real rows per slot."""
    T = slot_i.shape[0]
    valid = (jnp.arange(T) < num_valid)[:, None]  # bool[T, 1]
    ids = jnp.where(valid, slot_i, num_slots).reshape(-1)  # padding -> dropped bin
    return jnp.zeros((num_slots + 1,), jnp.float32).at[ids].add(1.0, mode="drop")[:num_slots]
