"""Data-parallel attention ranks in the scheduler: each rank's share of one step, its load,
and which rank an admitted request is placed on.

Plain Python (no JAX). With ``--dp-size D`` a step is the union of D rank-local batches; the
per-step limits (token rows = chunked prefill budget, logits rows, running requests) hold per
rank. A request is placed on one rank when it is admitted and stays there while it holds that
rank's KV pages and state slot; after a retraction it may be placed anew.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.mem_cache.rank_pools import RankPools


@dataclasses.dataclass
class RankStep:
    """What one rank may still take in the step being scheduled.

    budget:    token rows left (of ``max_tokens_per_step``, per rank).
    rows_left: logits rows left (of ``max_logits_rows``, per rank).
    reserve:   KV pages admission keeps free for the rank's decode-ready requests.
    running:   requests running on the rank (admission stops at ``max_running_requests``).
    num_prefill: prefill chunks taken so far.
    """

    budget: int
    rows_left: int
    reserve: int = 0
    running: int = 0
    num_prefill: int = 0


def rank_load(pools: RankPools, running: Iterable[Req]) -> tuple[int, int]:
    """A rank's load: (tokens, pages). Tokens: the prompt + output tokens of the requests
    running on it (in its KV cache or queued there for prefill); pages: its KV pages in use."""
    return sum(r.num_fill for r in running), pools.page_pool.num_used


def pick_rank(candidates: Sequence[int], loads: Sequence[tuple[int, int]]) -> int:
    """The least-loaded of the candidate ranks; ties go to the lowest rank."""
    return min(candidates, key=lambda k: (loads[k], k))
