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
     rewritten by later steps); the GDN slots are left as they were and ``states`` holds the
     state after every position.
  3. Accept (engine): with a_r drafts accepted the request keeps ``accepted_len[r] = 1 + a_r``
     positions (its last token and the accepted drafts) and logits row a_r gives its next
     token. Greedy: a_r is the longest prefix with ``d_{i+1} == argmax(logits row i)``.
  4. ``cache = commit_accepted_jit(cache, states, batch.state_slots, accepted_len)`` sets each
     slot to the state after its accepted positions; one compiled program for every
     accepted_len (an array, not a static value).

Exactness: on one implementation (XLA, or the Pallas kernels) the committed float32 GDN state
equals bit for bit the state that decoding the accepted tokens one by one leaves, given the
same GDN layer inputs (``kernels/gdn_verify.py``).
"""

from __future__ import annotations

import dataclasses

import jax

from kernels import gdn_verify
from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.models.qwen3_5_moe import ModelCache, Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyStates:
    """The GDN states a verify step leaves for the commit (Lyr GDN layers, R requests of the
    step, n = k+1 positions; padding requests are zero).

      windows:   [Lyr, R, K-1+n, C] (conv_state's dtype): the slot's conv state (K-1 rows,
                 oldest first; zeros if fresh) then the request's n pre-conv inputs. The conv
                 state after a positions is ``windows[:, r, a : a+K-1]``.
      rec_steps: [Lyr, R, n, Hv, Dk, Dv] (rec_state's dtype): the recurrent state after
                 positions 0..j at index j.
    """

    windows: jax.Array
    rec_steps: jax.Array


def forward_verify(params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig,
                   impl: str = "auto", batch_invariant: bool = False, ep=None,
                   with_hidden: bool = False):
    """One TARGET_VERIFY step (one device, or one DP rank under ``shard_map`` with ``ep``,
    ``parallel/dp_forward.py``). Returns (f32[L, V] logits of the rows
    ``batch.logits_indices``, the cache with KV written and GDN slots unchanged,
    :class:`VerifyStates`), and with ``with_hidden`` every row's hidden state [T, H] after
    the final norm (the MTP drafter's input, ``nextn_step.py``)."""
    if not batch.mode.is_verify():
        raise ValueError(f"forward_verify needs a TARGET_VERIFY batch, got {batch.mode!r}")
    hidden, cache, _, (windows, rec_steps) = qwen3_5_moe.forward_hidden(
        params, cache, batch, cfg, impl, ep=ep, batch_invariant=batch_invariant)
    logits = qwen3_5_moe.compute_logits(params, hidden, batch)
    out = logits, cache, VerifyStates(windows, rec_steps)
    return out + (hidden,) if with_hidden else out


def commit_accepted(cache: ModelCache, states: VerifyStates, slots, accepted_len) -> ModelCache:
    """Set each request's GDN slot (every layer) to its state after ``accepted_len`` positions.

    slots: i32[R] the verify batch's ``state_slots``; accepted_len: i32[R] in 0..n (1 + the
    accepted drafts; 0 leaves the slot as it is, and padding requests must pass 0). KV pages
    are not touched.
    """
    conv_state, rec_state = gdn_verify.commit_states(cache.conv_state, cache.rec_state,
                                                     states.windows, states.rec_steps, slots,
                                                     accepted_len)
    return dataclasses.replace(cache, conv_state=conv_state, rec_state=rec_state)


forward_verify_jit = jax.jit(forward_verify, static_argnames=("cfg", "impl", "batch_invariant",
                                                              "with_hidden"),
                             donate_argnames=("cache",))
commit_accepted_jit = jax.jit(commit_accepted, donate_argnames=("cache",))
