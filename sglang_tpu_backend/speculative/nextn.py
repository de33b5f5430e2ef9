"""NEXTN (MTP) drafts: proposed on the device by the model's own MTP layers.

Every step under NEXTN runs the MTP pass and chain after its sampler
(``model_executor/nextn_step.py``) and hands each sampling chunk's k drafts back with its
tokens; the scheduler keeps them in ``req.draft_state``. This drafter only returns them for
the next verify step (EAGLE is SGLang's other name for the same chain drafter here).
"""

from __future__ import annotations

from typing import Sequence

from sglang_tpu_backend.managers.schedule_batch import Req


class NextnDrafter:
    """The drafts the request's latest step left in ``req.draft_state`` (none before its
    first sampled token)."""

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        return [list(req.draft_state or [])[:k] for req in reqs]
