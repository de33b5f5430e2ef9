"""The host side of a TARGET_VERIFY step (speculative decoding): its draft inputs, and each
verify chunk's result from the step's outputs.

A verify step (``ModelRunner.launch``) runs the forward over every request's ``[last,
d_1 .. d_k]`` (``verify.forward_verify_jit``), the verify sampler on those n = k+1 logits rows
(``speculative.rejection.sample_verify_step``: exact-match acceptance for greedy rows,
rejection sampling for drawn ones, each position through the sampler's penalties, logit bias
and mask) and the commit of the accepted positions into the GDN slots
(``verify.commit_accepted_jit``). Every request accepts drafts this way; the host's part is
the per-position bitmasks: a grammar's mask after each draft (``Grammar.fill_draft_bitmasks``,
drafts cut at the first one it rejects) and the min_new_tokens ban of each position.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from sglang_tpu_backend.managers.schedule_batch import ChunkResult, ScheduledChunk
from sglang_tpu_backend.model_executor.sampler_state import ban_stop_tokens


@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """drafts i32[R, k]; num_drafts i32[R] the drafts each request may accept (0 for padding
    and for requests that accept none, fewer than k where a grammar rejects a draft);
    bitmask i32[R, n, W] each position's allowed tokens, or None (no row has a grammar or a
    min_new_tokens ban); num_cut: drafts cut by grammars (for the runner's count)."""

    drafts: np.ndarray
    num_drafts: np.ndarray
    bitmask: np.ndarray | None = None
    num_cut: int = 0


def verify_inputs(chunks: Sequence[ScheduledChunk], R: int, k: int, vocab_size: int,
                  mask: bool) -> VerifyInputs:
    """The draft inputs of one rank's verify chunks in a bucket of R requests; ``mask``
    builds the per-position bitmasks (the step's sampler variant has ``mask``)."""
    drafts, num_drafts = np.zeros((R, k), np.int32), np.zeros(R, np.int32)
    bitmask = np.full((R, k + 1, (vocab_size + 31) // 32), -1, np.int32) if mask else None
    num_cut = 0
    for i, c in enumerate(chunks):
        drafts[i] = c.drafts
        num_drafts[i] = k if c.accept_drafts else 0
        if bitmask is None:
            continue
        req, sp = c.req, c.req.sampling
        if req.grammar is not None:
            allowed = req.grammar.fill_draft_bitmasks(c.drafts[: num_drafts[i]], bitmask[i])
            num_cut += int(num_drafts[i]) - allowed
            num_drafts[i] = allowed
        for j in range(min(k + 1, max(0, sp.min_new_tokens - req.num_sampled))):
            ban_stop_tokens(bitmask[i, j].view(np.uint32), req, vocab_size)
    return VerifyInputs(drafts, num_drafts, bitmask, num_cut)


def concat_verify_inputs(per_rank: Sequence[VerifyInputs]) -> VerifyInputs:
    """The DP ranks' draft inputs, rank after rank ([D*R] rows)."""
    if len(per_rank) == 1:
        return per_rank[0]
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs)  # noqa: E731
    return VerifyInputs(cat([x.drafts for x in per_rank]), cat([x.num_drafts for x in per_rank]),
                        cat([x.bitmask for x in per_rank]), sum(x.num_cut for x in per_rank))


def dummy_verify_inputs(R: int, k: int, vocab_size: int, mask: bool) -> VerifyInputs:
    """All-padding draft inputs (warm-up)."""
    return verify_inputs([], R, k, vocab_size, mask)


def sampling_view(c: ScheduledChunk) -> ScheduledChunk:
    """The verify chunk as ``sampling_inputs`` sees it: a decode of its last token (row 0),
    whose per-request values (temperature, seed, step, penalty slot, bias) the verify
    sampler reads; its bitmask comes from ``verify_inputs``."""
    return dataclasses.replace(c, num_tokens=1, logits="last", drafts=None)


def verify_chunk_result(out: dict, i: int, c: ScheduledChunk) -> ChunkResult:
    """Chunk ``c``'s result (request row ``i``) from the host outputs of a verify step
    (``sample_verify_step``'s): its accepted drafts and next token, with their logprobs."""
    n_top = c.req.top_logprobs_num
    a = int(out["num_accepted"][i])
    run = []
    for j in range(a + 1):
        top = None
        if out.get("top_ids") is not None and n_top:
            top = list(zip(out["top_logprobs"][i, j, :n_top].tolist(),
                           out["top_ids"][i, j, :n_top].tolist()))
        run.append((int(out["tokens"][i, j]), float(out["logprobs"][i, j]), top))
    return ChunkResult(run=run, num_accepted=a)
