"""Which engine replica serves a request: Serve request routers (``serve.request_router``).

``PrefixAffinityRouter`` (colocated engines and prefill replicas): requests whose leading
``affinity_tokens`` tokens (whole KV pages) are equal go to the same replica, where its prefix
cache holds them. The ingress computes the request's ``routing_key`` (``prefix_key``) and passes
it to the replica call; the router ranks the candidates by rendezvous hashing of that key
(highest ``blake2b(key, replica id)`` first: stable as replicas come and go, and the same in
every ingress replica). The first-ranked replica is preferred unless it is full or its queue
is ``imbalance`` requests longer than the shortest, then the least loaded serves it (ties
broken at random), as requests without a key (shorter than one page, or affinity off) are
always served.

``FreeKVRouter`` (decode replicas): the replica reporting the most free KV tokens
(``EngineServer.record_routing_stats``) first, the rest by Serve's queue-length choice.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def prefix_key(token_ids: Sequence[int], page_size: int, affinity_tokens: int) -> str | None:
    """A digest of the request's leading whole pages, at most ``affinity_tokens`` tokens (at
    least one page); None when it has no whole page or affinity is off (``affinity_tokens`` 0)."""
    if affinity_tokens <= 0:
        return None
    n = min(len(token_ids), max(affinity_tokens, page_size)) // page_size * page_size
    if n == 0:
        return None
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids[:n])
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` by decreasing ``blake2b(key, id)``: the first is ``key``'s replica."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}/{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def _shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """One rank of equals: Serve takes its shortest queue, ties to the first, so a random
    order spreads requests over equally loaded replicas (as power-of-two choices does)."""
    return random.sample(replicas, len(replicas))


def routing_key(pending: PendingRequest | None) -> str | None:
    return None if pending is None else pending.kwargs.get("routing_key")


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prefix-cache affinity with a load guard (module docstring)."""

    def initialize_state(self, imbalance: int = 4, **_: Any) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = routing_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [_shuffled(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[i] for i in rendezvous_rank(key, list(by_id))]
        if self._queue_len(ranked[0]) - min(map(self._queue_len, ranked)) > self.imbalance:
            return [_shuffled(candidate_replicas)]  # busy: the least loaded of all
        return [ranked[:1], ranked[1:]]

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


class FreeKVRouter(FIFOMixin, RequestRouter):
    """Most free KV room first (module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, reverse=True,
                        key=lambda r: (r.routing_stats or {}).get("free_kv_tokens", 0))
        return [ranked[:1], ranked[1:]]
