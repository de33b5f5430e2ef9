"""Speculative verification on the model: one step over each request's last token and its k
drafts, then the commit of the accepted prefix into the GDN state slots.

The seam for the engine (drafting and acceptance live there, not here):
  1. Build a ``ForwardMode.TARGET_VERIFY`` batch: request r contributes n = k+1 tokens
     ``[last, d_1 .. d_k]`` at positions ``context_r .. context_r + k`` and wants logits for
     every row (``build_forward_batch(..., mode=TARGET_VERIFY)`` with ``logits="all"``; every
     request, padding ones included, owns exactly n rows: T = R * n).
  2. ``logits, cache, states = forward_verify_jit(params, cache, batch, cfg, impl)``: logits
     row i of request r predicts the token after its position i; attention KV is written for
     all n positions (those past the accepted ones lie past the request's length and are
     rewritten by later steps); the GDN slots are left as they were and ``states`` holds
     each GDN layer's conv windows and gate inputs (not the state after every position).
  3. Accept (engine): with a_r drafts accepted the request keeps ``accepted_len[r] = 1 + a_r``
     positions (its last token and the accepted drafts) and logits row a_r gives its next
     token. Greedy: a_r is the longest prefix with ``d_{i+1} == argmax(logits row i)``.
  4. ``cache = commit_accepted_jit(params, cache, states, batch.state_slots, accepted_len,
     cfg=cfg, impl=impl)`` sets each slot to the state after its accepted positions by running
     the GDN recurrence of those positions again (not the model); one compiled program for
     every accepted_len (an array, not a static value).

Exactness: on one implementation (XLA, or the Pallas kernels) the committed float32 GDN state
equals bit for bit the state that decoding the accepted tokens one by one leaves, given the
same GDN layer inputs (``kernels/gdn_verify.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig
from sglang_tpu_backend.kernels import gdn_verify
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.models.qwen3_5_moe import ModelCache, Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyStates:
    """What a verify step leaves for the commit (Lyr GDN layers, R requests of the step,
    n = k+1 positions; padding requests are zero). The commit re-applies the accepted
    positions of the GDN recurrence from these and the slots (``gdn_verify.commit_states``).

      windows: [Lyr, R, K-1+n, C] (conv_state's dtype): the slot's conv state (K-1 rows,
               oldest first; zeros if fresh) then the request's n pre-conv inputs. The conv
               state after a positions is ``windows[:, r, a : a+K-1]``.
      a, b:    [Lyr, R, n, Hv] (activation dtype): each position's gate inputs.
      fresh:   bool[R]: the request started from zero states (its slot was not read).
    """

    windows: jax.Array
    a: jax.Array
    b: jax.Array
    fresh: jax.Array


def forward_verify(params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig,
                   impl: str = "auto", batch_invariant: bool = False, ep=None,
                   with_hidden: bool = False, tp=None):
    """One TARGET_VERIFY step (one device, or one DP rank under ``shard_map`` with ``ep``,
    ``parallel/dp_forward.py``, or one TP device's heads with ``tp`` and ``cfg`` its local
    config, ``parallel/tp_forward.py``: then the states hold that device's channels and value
    heads). Returns (f32[L, V] logits of the rows
    ``batch.logits_indices``, the cache with KV written and GDN slots unchanged,
    :class:`VerifyStates`), and with ``with_hidden`` every row's hidden state [T, H] after
    the final norm (the MTP drafter's input, ``nextn_step.py``)."""
    if not batch.mode.is_verify():
        raise ValueError(f"forward_verify needs a TARGET_VERIFY batch, got {batch.mode!r}")
    hidden, cache, _, (windows, a, b) = qwen3_5_moe.forward_hidden(
        params, cache, batch, cfg, impl, ep=ep, tp=tp, batch_invariant=batch_invariant)
    logits = qwen3_5_moe.compute_logits(params, hidden, batch)
    n = batch.input_ids.shape[0] // batch.kv_lens.shape[0]
    out = logits, cache, VerifyStates(windows, a, b, fresh=batch.kv_lens <= n)
    return out + (hidden,) if with_hidden else out


def gdn_layer_params(params: Params, cfg: ModelConfig):
    """Every GDN layer's (conv1d [Lyr, C, K], A_log f32[Lyr, Hv], dt_bias f32[Lyr, Hv]) in the
    cache's GDN layer order (group g's i-th GDN layer is layer g * lin_per_group + i)."""
    groups = [g["linear_attn"] for g, kind in zip(params["layer_groups"],
                                                  cfg.layer_types[:cfg.layer_period])
              if kind != FULL_ATTENTION]
    stack = lambda name: jnp.stack([g[name] for g in groups], 1).reshape(  # noqa: E731
        -1, *groups[0][name].shape[1:])
    return stack("conv1d"), stack("A_log"), stack("dt_bias")


def commit_accepted(params: Params, cache: ModelCache, states: VerifyStates, slots, accepted_len,
                    cfg: ModelConfig, impl: str = "auto") -> ModelCache:
    """Set each request's GDN slot (every layer) to its state after ``accepted_len`` positions:
    the GDN recurrence of those positions runs again from the slot (``gdn_verify.commit_states``).

    slots: i32[R] the verify batch's ``state_slots``; accepted_len: i32[R] in 0..n (1 + the
    accepted drafts; 0 leaves the slot as it is, and padding requests must pass 0). KV pages
    are not touched. Under TP each device runs this on its own channels and value heads
    (``cfg`` its local config): the recurrence does not mix heads, so no collective.
    """
    conv_weight, A_log, dt_bias = gdn_layer_params(params, cfg)
    conv_state, rec_state = gdn_verify.commit_states(
        cache.conv_state, cache.rec_state, states.windows, states.a, states.b, states.fresh,
        conv_weight, A_log, dt_bias, slots, accepted_len, num_k_heads=cfg.linear_num_key_heads,
        impl=impl)
    return dataclasses.replace(cache, conv_state=conv_state, rec_state=rec_state)


forward_verify_jit = jax.jit(forward_verify, static_argnames=("cfg", "impl", "batch_invariant",
                                                              "with_hidden"),
                             donate_argnames=("cache",))
commit_accepted_jit = jax.jit(commit_accepted, static_argnames=("cfg", "impl"),
                              donate_argnames=("cache",))
