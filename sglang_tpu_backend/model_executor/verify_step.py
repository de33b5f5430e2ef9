"""The host side of a TARGET_VERIFY step (speculative decoding): its draft inputs, and each
verify chunk's result from the step's outputs.

A verify step (``ModelRunner.launch``) runs the forward over every request's ``[last,
d_1 .. d_k]`` (``verify.forward_verify_jit``), greedy acceptance on the logits
(``speculative/greedy.py``), the commit of the accepted positions into the GDN slots
(``verify.commit_accepted_jit``) and the ordinary sampler on row 0 of each request, whose
token a request that may not accept drafts (temperature > 0, penalties, a grammar, ...)
takes: it then advances exactly as a non-speculative decode step would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from sglang_tpu_backend.managers.schedule_batch import ChunkResult, ScheduledChunk


@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """drafts i32[R, k]; accept bool[R] (greedy acceptance on); real bool[R] (not padding)."""

    drafts: np.ndarray
    accept: np.ndarray
    real: np.ndarray


def verify_inputs(chunks: Sequence[ScheduledChunk], R: int, k: int) -> VerifyInputs:
    """The draft inputs of one rank's verify chunks in a bucket of R requests."""
    drafts = np.zeros((R, k), np.int32)
    accept, real = np.zeros(R, np.bool_), np.zeros(R, np.bool_)
    for i, c in enumerate(chunks):
        drafts[i] = c.drafts
        accept[i], real[i] = c.accept_drafts, True
    return VerifyInputs(drafts, accept, real)


def concat_verify_inputs(per_rank: Sequence[VerifyInputs]) -> VerifyInputs:
    """The DP ranks' draft inputs, rank after rank ([D*R] rows)."""
    return VerifyInputs(*(np.concatenate([getattr(x, f.name) for x in per_rank])
                          for f in dataclasses.fields(VerifyInputs)))


def dummy_verify_inputs(R: int, k: int) -> VerifyInputs:
    """All-padding draft inputs (warm-up)."""
    return verify_inputs([], R, k)


def sampling_view(c: ScheduledChunk) -> ScheduledChunk:
    """The verify chunk as the sampler sees it: a decode of its last token (row 0)."""
    return dataclasses.replace(c, num_tokens=1, logits="last", drafts=None)


def verify_chunk_result(out: dict, i: int, c: ScheduledChunk) -> ChunkResult:
    """Chunk ``c``'s result (request row ``i``) from the host outputs of a verify step: the
    greedy acceptance's ``spec_*`` arrays, or the sampler's row when it may not accept."""
    n_top = c.req.top_logprobs_num
    if not c.accept_drafts:
        top = None
        if out.get("top_ids") is not None and n_top:
            top = list(zip(out["top_logprobs"][i, :n_top].tolist(),
                           out["top_ids"][i, :n_top].tolist()))
        return ChunkResult(run=[(int(out["tokens"][i]), float(out["logprobs"][i]), top)])
    a = int(out["spec_num_accepted"][i])
    run = []
    for j in range(a + 1):
        top = None
        if out.get("spec_top_ids") is not None and n_top:
            top = list(zip(out["spec_top_logprobs"][i, j, :n_top].tolist(),
                           out["spec_top_ids"][i, j, :n_top].tolist()))
        run.append((int(out["spec_tokens"][i, j]), float(out["spec_logprobs"][i, j]), top))
    return ChunkResult(run=run, num_accepted=a)
