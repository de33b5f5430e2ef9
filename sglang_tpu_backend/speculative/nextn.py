"""NEXTN (MTP) drafts: proposed on the device by the model's own MTP layers.

Every step under NEXTN runs the MTP pass and chain after its sampler
(``model_executor/nextn_step.py``) and hands each sampling chunk's k drafts back with its
tokens; the scheduler keeps them in ``req.draft_state``. This drafter only returns them for
the next verify step (EAGLE is SGLang's other name for the same chain drafter here).
"""

from __future__ import annotations

from typing import Sequence

from sglang_tpu_backend.managers.schedule_batch import Req, ScheduledChunk
from sglang_tpu_backend.speculative.drafter import DraftGuard


def chain_wanted(chunks: Sequence[ScheduledChunk]) -> bool:
    """Whether a step's MTP chain may be used: some request sampling in it may propose
    drafts next step (no back-off pause under way). Otherwise the step runs only the MTP
    pass, which keeps the MTP KV current, and leaves no drafts."""
    return any(c.sample and (c.req.draft_guard is None or c.req.draft_guard.may_allow_next())
               for c in chunks)


class NextnDrafter:
    """The drafts the request's latest step left in ``req.draft_state`` (none before its
    first sampled token), held back by the request's ``DraftGuard`` (``req.draft_guard``)
    while its drafts keep being rejected: the MTP layer still runs every step, but the
    step need not verify drafts that do not pay."""

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        out = []
        for req in reqs:
            if req.draft_guard is None:
                req.draft_guard = DraftGuard()
            guard, n = req.draft_guard, len(req.prompt_ids) + len(req.output_ids)
            if guard.judged_from is not None:
                guard.judge(req.fill_slice(guard.judged_from, n - guard.judged_from))
            drafts = list(req.draft_state or [])[:k] if guard.allow() else []
            guard.proposed(n, drafts)
            out.append(drafts)
        return out
