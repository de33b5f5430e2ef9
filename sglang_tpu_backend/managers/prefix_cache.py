"""How the scheduler uses the per-rank radix caches (``mem_cache/radix_cache.py``).

Plain Python (no JAX). Page size ``P``; a prompt of ``n`` tokens has snapshot points at the
multiples of ``P`` up to ``last_point = ((n - 1) // P) * P`` (at least one prompt token is
always left to prefill, so the request still gets logits). With the cache on:

* Admission: a request matches, on each rank, the longest cached prefix of its prompt that
  ends at a snapshot (capped at the first prompt-logprob row it asks for); it is placed on
  the rank with the longest match, locks that node, starts with the node's pages as the head
  of its page table and ``num_computed`` at the match, and the step first copies the
  snapshot into its state slot (a ``SnapshotLoad``).
* Chunking: a prefill chunk that would cross ``last_point`` ends there, and other chunk
  ends inside the prompt are rounded down to a page boundary, so every prefill chunk of a
  prompt ends at a snapshot point (or at the prompt's end).
* Saving: when a chunk ends at a snapshot point not yet cached, a snapshot id is taken and
  the step copies the request's state slot into it after the forward (a ``SnapshotSave``);
  after the step the prefix is inserted into the tree (``commit``). The request then holds
  the tree's pages for that prefix (pages the tree already had replace its own, which are
  freed) and moves its lock down to the new node.
* Siblings: a waiting request whose prompt shares at least a page-aligned snapshot point
  more than it can match now with a request still prefilling that part waits for it
  (``n > 1`` samples and ``fork`` branches are prefilled once, then fan out).
* Release (finish, abort, retraction): the lock is dropped and the pages the request owns
  (those after its cached prefix) go back to the pool; cached pages stay in the tree until
  evicted (LRU, unlocked leaves first) when pages or snapshots run short.
"""

from __future__ import annotations

from typing import Iterable

from sglang_tpu_backend.managers.schedule_batch import Req, SnapshotLoad, SnapshotSave
from sglang_tpu_backend.mem_cache.radix_cache import PrefixMatch, RadixCache


class PrefixCache:
    """The radix caches of all DP ranks (``caches[k]`` uses rank k's pools)."""

    def __init__(self, caches: list[RadixCache]):
        self.caches = caches
        self.page_size = caches[0].page_size
        # rid -> {snapshot point: chunk start} of snapshot saves launched but not committed.
        self._saving: dict[str, dict[int, int]] = {}

    # Snapshot points -------------------------------------------------------------------
    def last_point(self, req: Req) -> int:
        """The deepest snapshot point of the prompt (leaves >= 1 prompt token to prefill)."""
        return (len(req.prompt_ids) - 1) // self.page_size * self.page_size

    def match_limit(self, req: Req) -> int:
        """Longest prefix a match may cover: up to ``last_point`` and not past the first prompt
        row whose logprob is asked for (those rows must be computed)."""
        limit = self.last_point(req)
        if req.return_logprob:
            limit = min(limit, req.logprob_start_len // self.page_size * self.page_size)
        return limit

    # Admission -------------------------------------------------------------------------
    def match(self, req: Req, rank: int) -> PrefixMatch:
        return self.caches[rank].match_prefix(req.prompt_ids, self.match_limit(req))

    def admit(self, req: Req, rank: int, m: PrefixMatch, loads: list[SnapshotLoad]) -> None:
        """Start ``req`` (slot already allocated on ``rank``) from the matched prefix."""
        req.cached_tokens = m.length
        if m.length == 0:
            return
        self.caches[rank].lock(m.node)
        req.cache_node = m.node
        req.num_shared_pages = len(m.pages)
        req.pages = list(m.pages)
        req.num_computed = m.length
        loads.append(SnapshotLoad(rank=rank, snapshot=m.snapshot, slot=req.state_slot))

    def should_wait(self, req: Req, running: Iterable[Req]) -> bool:
        """True when a running request is still prefilling a prefix ``req`` shares beyond
        what ``req`` can match now: admitting ``req`` later lets it reuse that prefill."""
        limit, P = self.match_limit(req), self.page_size
        if limit <= 0:
            return False
        prompt = req.prompt_ids
        for other in running:
            shared = min(limit, self.last_point(other))
            done = self._committed(other)
            if done >= shared or other.prompt_ids[:P] != prompt[:P]:
                continue
            k = P
            while k + P <= shared and other.prompt_ids[k:k + P] == prompt[k:k + P]:
                k += P
            if k > done and k > self.match(req, other.dp_rank).length:
                return True
        return False

    def _committed(self, req: Req) -> int:
        """Prompt tokens of ``req`` that the tree may already hold: its computed tokens, less
        those of steps whose snapshot is still on its way (launched, not yet committed)."""
        pending = self._saving.get(req.rid)
        return min(req.num_computed, *pending.values()) if pending else req.num_computed

    # Chunking and saving ---------------------------------------------------------------
    def limit_chunk(self, req: Req, start: int, n: int) -> int:
        """Shorten a prefill chunk ``[start, start+n)`` to end at a snapshot point."""
        end, last = start + n, self.last_point(req)
        if start < last < end:
            return last - start
        if end < last:
            aligned = end // self.page_size * self.page_size
            if aligned > start:
                return aligned - start
        return n

    def plan_save(self, req: Req, start: int, n: int, saves: list[SnapshotSave]) -> None:
        """Take a snapshot at the end of chunk ``[start, start+n)`` if it is a new snapshot point."""
        end, P = start + n, self.page_size
        if (end % P or end > self.last_point(req) or end <= req.num_shared_pages * P
                or (req.cache_node is not None and req.cache_node.doomed)):
            return
        cache = self.caches[req.dp_rank]
        if cache.has_snapshot_at(req.prompt_ids, end):
            return
        if cache.snapshot_pool.num_free == 0:
            cache.evict(num_snapshots=1)  # unlocked leaves first
        if cache.snapshot_pool.num_free == 0:
            cache.drop_snapshot()  # else the oldest snapshot, so the prompt's last point gets one
        snapshot = cache.snapshot_pool.allocate()
        if snapshot is not None:
            saves.append(SnapshotSave(req=req, rank=req.dp_rank, slot=req.state_slot,
                                      snapshot=snapshot, num_tokens=end))
            self._saving.setdefault(req.rid, {})[end] = start

    def commit(self, saves: list[SnapshotSave], running: list[Req]) -> None:
        """After the step: insert each saved prefix into its rank's tree. Consumes ``saves``
        (after an exception the ones left were never committed: ``discard`` them)."""
        self._settle(saves)
        while saves:
            s = saves.pop(0)
            req, cache = s.req, self.caches[s.rank]
            if (req.finished or req not in running or req.dp_rank != s.rank
                    or (req.cache_node is not None and req.cache_node.doomed)):
                cache.snapshot_pool.free(s.snapshot)  # aborted / retracted / flushed meanwhile
                continue
            n = s.num_tokens // self.page_size
            node, pages, unused, taken = cache.insert(req.prompt_ids[:s.num_tokens], req.pages[:n],
                                                      s.snapshot)
            if not taken:
                cache.snapshot_pool.free(s.snapshot)
            cache.lock(node)
            if req.cache_node is not None:
                cache.unlock(req.cache_node)
            req.cache_node = node
            req.pages[:n] = pages
            req.num_shared_pages = n
            if unused:
                cache.page_pool.free(unused)

    def discard(self, saves: list[SnapshotSave]) -> None:
        """A step that failed: its snapshots were never written; give their ids back.
        Consumes ``saves`` (a second call frees nothing twice)."""
        self._settle(saves)
        while saves:
            s = saves.pop()
            self.caches[s.rank].snapshot_pool.free(s.snapshot)

    def _settle(self, saves: list[SnapshotSave]) -> None:
        for s in saves:
            pending = self._saving.get(s.req.rid, {})
            pending.pop(s.num_tokens, None)
            if not pending:
                self._saving.pop(s.req.rid, None)

    # Release / memory ------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Drop the request's lock and free the pages it owns (those after its cached prefix)."""
        cache = self.caches[req.dp_rank]
        own = req.pages[req.num_shared_pages:]
        if own:
            cache.page_pool.free(own)
        req.pages = []
        if req.cache_node is not None:
            cache.unlock(req.cache_node)
        req.cache_node = None
        req.num_shared_pages = 0

    def num_evictable_pages(self, rank: int) -> int:
        return self.caches[rank].num_evictable_pages

    def evict_pages(self, rank: int, num_free: int) -> None:
        """Evict until ``num_free`` pages are free on ``rank`` (or nothing is evictable)."""
        self.caches[rank].evict(num_pages=num_free)

    def flush(self) -> None:
        for cache in self.caches:
            cache.flush()

    def stats(self, rank: int) -> dict[str, int]:
        cache = self.caches[rank]
        return {
            "kv_pages_cached": cache.num_cached_pages,
            "kv_pages_evictable": cache.num_evictable_pages,
            "kv_pages_evicted_total": cache.num_evicted_pages,
            "gdn_snapshots_used": cache.snapshot_pool.num_used,
            "gdn_snapshots_total": cache.snapshot_pool.num_snapshots,
        }
