"""Which DECODE steps run as multi-step launches (``--num-scheduler-steps`` N > 1).

A decode-ready request may take N tokens in one launch when its next N tokens need no host
work between them (no grammar, no ``min_new_tokens`` ban left, no routed experts), it asks for
no top logprobs (the multi-step programs are compiled without them: one program per bucket,
not two, whose branches are the sampler variants; the chosen tokens' logprobs are always
there) and they fit in its context; tokens past max_new_tokens or a stop are computed and
dropped on the host. A DECODE batch runs N steps only when every request may and every chunk
holds pages for N more positions (the scheduler asks for them without retracting anyone);
else it runs one.
"""

from __future__ import annotations

from sglang_tpu_backend.managers.schedule_batch import Req, ScheduledChunk
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.mem_cache.rank_pools import RankPools
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode


def multistep_ok(req: Req, num_scheduler_steps: int) -> bool:
    """``req`` may take ``num_scheduler_steps`` (N > 1) tokens in one launch."""
    N = num_scheduler_steps
    return (N > 1 and req.grammar is None and not req.return_routed_experts
            and not req.wants_top_logprobs
            and req.num_sampled >= req.sampling.min_new_tokens
            and req.num_fill + N <= req.context_length)


def num_steps(chunks: list[ScheduledChunk], kind: ForwardMode, num_scheduler_steps: int,
              pools: list[RankPools]) -> int:
    """Decode steps of a step of ``chunks``: N for a DECODE step whose every request is
    ``multistep_ok`` and whose every chunk holds pages for N more positions (``pools`` per DP
    rank), else 1."""
    N = num_scheduler_steps
    if N <= 1 or kind != ForwardMode.DECODE:
        return 1
    for c in chunks:
        page_size = pools[c.dp_rank].page_pool.page_size
        if not multistep_ok(c.req, N) or len(c.pages) < pages_for(c.start + N, page_size):
            return 1
    return N
