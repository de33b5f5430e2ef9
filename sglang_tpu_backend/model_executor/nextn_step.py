"""NEXTN (MTP) drafting on the device: after every step the MTP pass over the step's rows,
then the chain of drafts the next step verifies (``--speculative-algorithm NEXTN``).

Every step under NEXTN (prefill, decode, mixed, verify) returns the target's hidden state of
each token row (after its final norm). The MTP pass (``models/mtp.py``) then runs over the
same rows, each with its NEXT token:
  - a prompt row: the next prompt token (host-known, also across a chunk boundary);
  - the row that samples (a chunk's last row): the token the sampler just drew;
  - row j of a verify chunk i: the verify sampler's ``tokens[i, j]``. For j <= a (a the
    accepted drafts) that is the sequence's true next token. Rows past a get the wrong next
    token and write garbage MTP KV at positions past the request's new length; every later
    step's MTP pass starts at the request's new last position and overwrites them before any
    attention reads them (a step reads MTP KV only at positions its own pass or chain wrote).
This writes the MTP KV of every computed position, at the target's page ids. The first draft
is the MTP argmax at each request's last valid row (verify: row a), and steps 2..k continue
from that row's MTP hidden output one position further each (``draft_chain``'s recurrence).

The chain writes MTP KV at up to k-1 positions past the request's last row, which may lie
past the pages the request owns. The MTP cache therefore has ``S`` scratch pages per request
row of the bucket after the pool's ``num_pages``; the chain's page table lists the request's
own pages, then cycles over its scratch pages (the chain's positions are contiguous and span
at most ``S`` pages, so no two share a scratch page). What lands there is never read by a
later step. Positions inside the request's own pages past its length are overwritten by the
next step's MTP pass as above.

Prefix cache: a cached prefix's MTP KV was written by the request that filled those pages;
its last cached position may hold the MTP KV computed with a different next token. That only
lowers draft quality: drafts are verified by the target, outputs never depend on them.
Retraction re-prefills the request, which recomputes its MTP KV.

Dimension letters: T token rows, R requests, P chain pages per request, H hidden, k drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.managers.schedule_batch import ScheduledChunk
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.models.mtp import mtp_forward


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MtpInputs:
    """Host-built inputs of one step's MTP pass (numpy; padding rows zero).

    next_ids:     i32[T] each row's next token where the host knows it (else 0).
    from_sampled: i32[T] index into the step's flattened sampled tokens (``tokens`` [R] of a
                  sampler step, [R, n] of a verify step) of each row's next token, -1: use
                  ``next_ids``.
    draft_rows:   i32[R] each request's last row (verify: its row 0; the device adds
                  accepted_len - 1).
    page_table:   i32[R, P] the request's own pages, then its scratch pages cyclically.
    """

    next_ids: np.ndarray
    from_sampled: np.ndarray
    draft_rows: np.ndarray
    page_table: np.ndarray


def mtp_drafts(params: Any, mtp_params: Any, cache: jax.Array, batch: ForwardBatch,
               hidden: jax.Array, inp: MtpInputs, sampled: jax.Array, accepted_len: jax.Array,
               cfg: ModelConfig, impl: str, num_steps: int, ep=None, tp=None
               ) -> tuple[jax.Array, jax.Array]:
    """The MTP pass over the step's rows and the chain after each request's last valid row
    (one device, or one DP rank under ``shard_map`` with ``ep``: all arrays rank-local, or
    one TP device with ``tp``: its heads of the MTP cache, every other array replicated).

    batch: the step's ForwardBatch; hidden [T, H] its rows' hidden states; sampled: the
    step's sampled tokens (i32[R] or i32[R, n]); accepted_len i32[R] (1 unless verify).
    Returns (drafts i32[R, num_steps], the MTP cache). ``num_steps`` 0 runs the MTP pass
    only (its KV written, no LM head, no chain): a step none of whose requests will draft.
    """
    flat = sampled.reshape(-1)
    ids = jnp.where(inp.from_sampled >= 0, flat[jnp.maximum(inp.from_sampled, 0)], inp.next_ids)
    rows = inp.draft_rows + jnp.maximum(accepted_len - 1, 0)
    R = rows.shape[0]
    batch = dataclasses.replace(batch, input_ids=ids, page_table=inp.page_table,
                                logits_indices=rows if num_steps else rows[:0])
    logits, out, cache = mtp_forward(params, mtp_params, cache, batch, hidden, cfg, impl, 0,
                                     ep=ep, tp=tp)
    if not num_steps:
        return jnp.zeros((R, 0), jnp.int32), cache
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R]
    num_seqs = batch.num_seqs[0]
    positions = batch.positions[rows] + 1
    chain = ForwardBatch(
        input_ids=token, positions=positions,
        cu_q_lens=jnp.minimum(jnp.arange(R + 1, dtype=jnp.int32), num_seqs),
        kv_lens=jnp.where(jnp.arange(R) < num_seqs, positions + 1, 0).astype(jnp.int32),
        page_table=inp.page_table, state_slots=batch.state_slots, num_seqs=batch.num_seqs,
        logits_indices=jnp.arange(R, dtype=jnp.int32), mode=ForwardMode.DECODE)
    drafts, h = [token], out[rows]
    for s in range(1, num_steps):  # step s: x[p+s+1] at position p+s, fed its own output
        logits, h, cache = mtp_forward(params, mtp_params, cache, chain, h, cfg, impl, s, ep=ep,
                                       tp=tp)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(token)
        chain = dataclasses.replace(chain, input_ids=token, positions=chain.positions + 1,
                                    kv_lens=jnp.where(chain.kv_lens > 0, chain.kv_lens + 1, 0))
    return jnp.stack(drafts, axis=1), cache


mtp_drafts_jit = jax.jit(mtp_drafts, static_argnames=("cfg", "impl", "num_steps"),
                         donate_argnames=("cache",))


class NextnDrafts:
    """The runner's MTP side: params (placed like the main ones by the step backend), the MTP
    KV cache (per rank: the pool's ``num_pages`` at the target's page ids, then the scratch
    pages) and the per-step program (``backend.mtp_drafts``)."""

    def __init__(self, backend: Any, mtp_params: Any, *, num_steps: int, num_pages: int,
                 page_size: int, max_reqs: int, context_length: int, kv_dtype: Any):
        """``backend``: the runner's ``StepBackend``; ``num_pages`` per rank; ``max_reqs``:
        the largest request bucket (rows that get scratch pages)."""
        self.backend, self.num_steps, self.num_pages = backend, num_steps, num_pages
        self.scratch_per_req = pages_for(num_steps, page_size) + 1  # S
        self.pages_per_seq = pages_for(context_length + 2 * num_steps, page_size)
        self.params = backend.place_mtp_params(mtp_params)
        self.num_passes_without_chain = 0  # steps that ran the MTP pass only
        self.cache = backend.init_mtp_cache(
            num_pages=num_pages + max_reqs * self.scratch_per_req, page_size=page_size,
            kv_dtype=kv_dtype)

    def inputs(self, chunks: Sequence[ScheduledChunk], T: int, R: int) -> MtpInputs:
        """The MTP inputs of one rank's chunks in bucket (T, R) (module docstring)."""
        next_ids, from_sampled = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        draft_rows = np.zeros(R, np.int32)
        page_table = np.zeros((R, self.pages_per_seq), np.int32)
        offset = 0
        for i, c in enumerate(chunks):
            n = c.num_tokens
            if c.is_verify:
                from_sampled[offset:offset + n] = i * n + np.arange(n)
                draft_rows[i] = offset
            else:
                known = c.req.fill_slice(c.start + 1, n)
                next_ids[offset:offset + len(known)] = known
                if c.sample:
                    from_sampled[offset + n - 1] = i
                draft_rows[i] = offset + n - 1
            page_table[i] = self._page_row(c.pages, i)
            offset += n
        return MtpInputs(next_ids, from_sampled, draft_rows, page_table)

    def _page_row(self, pages: Sequence[int], i: int) -> np.ndarray:
        """Request row ``i``'s chain page table: its pages, then its scratch pages cycled."""
        own = list(pages[:self.pages_per_seq])
        S = self.scratch_per_req
        base = self.num_pages + i * S
        rest = [base + j % S for j in range(self.pages_per_seq - len(own))]
        return np.asarray(own + rest, np.int32)

    def run(self, params: Any, fbs: Sequence[ForwardBatch], hidden: jax.Array,
            inps: Sequence[MtpInputs], sampled: jax.Array, accepted_len: Any,
            chain: bool = True) -> jax.Array:
        """Dispatch the step's MTP pass and chain on one batch and MTP input per rank (cache
        donated); i32[D*R, k] drafts on the device, rank after rank. Without ``chain`` only
        the pass runs (it keeps the MTP KV current) and the drafts are i32[D*R, 0]."""
        drafts, self.cache = self.backend.mtp_drafts(
            params, self.params, self.cache, fbs, hidden, inps, sampled, accepted_len,
            self.num_steps if chain else 0)
        self.num_passes_without_chain += not chain
        return drafts

    def warm_up(self, params: Any, fbs: Sequence[ForwardBatch], hidden: jax.Array,
                sampled: Any, accepted_len: Any) -> None:
        """Compile the programs of ``fbs``' bucket (with and without the chain) on all-padding
        inputs (writes nothing)."""
        T, R = fbs[0].input_ids.shape[0], fbs[0].kv_lens.shape[0]
        for chain in (True, False):
            self.run(params, fbs, hidden, [self.inputs([], T, R)] * len(fbs), sampled,
                     accepted_len, chain)
