"""The device-side description of one model step: a ragged batch of requests.

A step mixes prefill (extend) chunks of some requests and single decode tokens of others.
Tokens are laid out request after request; request ``r`` owns token rows
``cu_q_lens[r]:cu_q_lens[r+1]``. Shapes are bucketed by the runner, so trailing rows past
``cu_q_lens[num_seqs]`` (tokens) and past ``num_seqs`` (requests) are padding: the model
writes no KV page and no GDN state for them, and their outputs are garbage to be ignored.

In ``ForwardMode.TARGET_VERIFY`` every request, padding requests included, owns exactly
n = T // R rows (``cu_q_lens[r] == r * n`` for the real ones), and the GDN layers rely on it.

Dimension letters: T tokens in the step (bucketed), R requests (bucketed), P pages per
request (max context / page size), L rows that need logits.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from sglang_tpu_backend.model_executor.forward_mode import ForwardMode

__all__ = ["ForwardBatch", "ForwardMode", "dummy_batch"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """Arrays of one step. Build it on the host (numpy) and pass it to the jitted forward.

    Attributes:
      input_ids:      i32[T] token ids.
      positions:      i32[T] absolute position of each token in its request (RoPE, causal mask).
      cu_q_lens:      i32[R+1] cumulative new-token counts; ``cu_q_lens[0] == 0``.
      kv_lens:        i32[R] tokens in the request's KV after this step (context + new).
                      ``kv_lens[r] - q_len[r] == 0`` means the request starts fresh: its GDN
                      conv and recurrent state are taken as zero, not read from the slot.
      page_table:     i32[R, P] KV page ids of each request, in order.
      state_slots:    i32[R] GDN state slot of each request (conv and recurrent state).
      num_seqs:       i32[1] number of real requests (rows past it are padding).
      logits_indices: i32[L] token rows whose logits the step returns (last token of each
                      request, or every prompt row when prompt logprobs are asked for).
      mode:           static ForwardMode.
    """

    input_ids: jax.Array
    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    state_slots: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    mode: ForwardMode = dataclasses.field(default=ForwardMode.MIXED, metadata=dict(static=True))


def dummy_batch(kind: ForwardMode, T: int, R: int, L: int, pages_per_seq: int) -> ForwardBatch:
    """An all-padding batch (num_seqs = 0) of bucket (T, R, L): writes nothing."""
    return ForwardBatch(
        input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
        cu_q_lens=np.zeros(R + 1, np.int32), kv_lens=np.zeros(R, np.int32),
        page_table=np.zeros((R, pages_per_seq), np.int32), state_slots=np.zeros(R, np.int32),
        num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(L, np.int32), mode=kind,
    )
