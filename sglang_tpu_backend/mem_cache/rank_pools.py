"""The KV page pool and GDN state-slot pool of each data-parallel attention rank.

With ``--dp-size D`` every DP rank owns its own shard of the KV cache and of the GDN state
(``parallel/dp_forward.py``), so page ids and slot ids are rank-local: rank r's page p is
global page ``r * num_pages + p``. A request's pages and slot all come from one rank's pools.
Plain Python, no tensors.
"""

from __future__ import annotations

import dataclasses

from sglang_tpu_backend.mem_cache.page_pool import PagePool
from sglang_tpu_backend.mem_cache.state_pool import StatePool


@dataclasses.dataclass
class RankPools:
    """One DP rank's pools: ``page_pool`` (pages of ``page_size`` tokens) and ``state_pool``."""

    page_pool: PagePool
    state_pool: StatePool

    @classmethod
    def per_rank(cls, dp_size: int, *, num_pages: int, page_size: int, num_slots: int
                 ) -> list["RankPools"]:
        """``dp_size`` ranks, each with ``num_pages`` pages and ``num_slots`` state slots."""
        return [cls(PagePool(num_pages, page_size), StatePool(num_slots)) for _ in range(dp_size)]

    def stats(self) -> dict[str, int]:
        return {
            "kv_pages_used": self.page_pool.num_used,
            "kv_pages_total": self.page_pool.num_pages,
            "state_slots_used": self.state_pool.num_used,
            "state_slots_total": self.state_pool.num_slots,
        }
