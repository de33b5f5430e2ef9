"""Continuous batching: which requests run in the next step, and bookkeeping of results.

Plain Python (no JAX). The scheduler serves ``dp_size`` data-parallel attention ranks (one with
``--dp-size 1``), each with its own KV page pool and GDN state-slot pool
(``mem_cache/rank_pools.py``); all limits below hold per rank. One step holds at most
``max_tokens_per_step`` token rows per rank: every decode-ready request contributes one token,
prefill chunks fill what is left (chunked prefill), new requests are admitted while a state slot,
``max_running_requests`` and KV pages allow, each on the least-loaded rank that can take it
(``managers/dp_placement.py``), where it stays. When decodes cannot get a KV page, the newest
running requests of that rank are retracted: pages and slot freed, requeued at the front,
re-prefilled later (possibly on another rank).

With a prefix cache (``managers/prefix_cache.py``, one radix tree per rank) admission starts a
request after its longest cached prefix, prefill chunks end at GDN snapshot points, and the tree's
unlocked pages count as free: they are evicted (LRU) when an allocation needs them.

Deterministic mode (``prefill_align`` set, ``--enable-deterministic-inference``): a step holds
either decodes only or prefill chunks only (prefill first, as SGLang without mixed chunks: decodes
wait while any prefill chunk can run), and a prefill chunk ends at a multiple of ``prefill_align``
tokens or at the end of what the request has to fill. Each request's chunk boundaries then depend
on the request alone, never on what shares the step.

Speculative decoding (``num_drafts`` k > 0, a ``drafter``): decodes and prefill chunks run in steps
of their own (prefill first, as in deterministic mode). The drafter is asked for each decode step:
when at least ``MIN_DRAFTED_FRACTION`` of the step's requests that may accept drafts (all DP ranks
together: they run one program) have drafts, the step runs as TARGET_VERIFY, every request with its
last token and exactly k drafts (the drafter's, padded); otherwise it runs as a plain DECODE step
and the drafts are dropped. A verify step costs every request k+1 rows, so drafts of a few requests
do not pay for it. A decode reserves pages for k+1 positions; after a verify step the request keeps
1 + the accepted drafts of them and the pages past its new length go back to the pool.

Multi-step decoding (``multistep_policy.py``): an eligible DECODE batch runs N decode steps in one
launch (``ScheduledBatch.num_steps``); ``process_result`` appends its N tokens one at a time with
the usual finish checks, dropping those after the finishing one.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable

from sglang_tpu_backend.managers import multistep_policy
from sglang_tpu_backend.managers.dp_placement import RankStep, pick_rank, rank_load
from sglang_tpu_backend.managers.prefix_cache import PrefixCache
from sglang_tpu_backend.managers.schedule_batch import (ChunkResult, Req, ScheduledBatch,
                                                        ScheduledChunk, SnapshotLoad, SnapshotSave)
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.mem_cache.radix_cache import RadixCache, SnapshotPool
from sglang_tpu_backend.mem_cache.rank_pools import RankPools
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_executor.routed_experts import append_rows
from sglang_tpu_backend.speculative.drafter import Drafter

logger = logging.getLogger(__name__)
# A decode step runs as TARGET_VERIFY when at least this fraction of its requests has drafts.
MIN_DRAFTED_FRACTION = 0.5


class _InFlight(Exception):
    """Scheduling would retract a request whose last sampled token is still in flight."""


class Scheduler:
    """Owns the waiting queue, the running list (all ranks, oldest first) and each rank's pools.

    ``max_running_requests``, ``max_tokens_per_step`` and ``max_logits_rows`` (one row per
    sampling request, one per prompt-logprob row) are per DP rank.
    """

    def __init__(
        self,
        pools: list[RankPools],
        *,
        max_running_requests: int,
        max_tokens_per_step: int,
        max_logits_rows: int | None = None,
        prefix: PrefixCache | None = None,
        prefill_align: int | None = None,
        max_prefill_chunks: int | None = None,
        drafter: Drafter | None = None,
        num_drafts: int = 0,
        num_scheduler_steps: int = 1,
    ):
        """``prefill_align``: deterministic mode (see the module docstring); None: off.
        ``max_prefill_chunks``: prefill chunks per step and rank (None: no limit).
        ``drafter`` / ``num_drafts``: speculative decoding (k drafts per verify step).
        ``num_scheduler_steps``: decode steps per multi-step launch (1: off)."""
        if (drafter is None) != (num_drafts == 0):
            raise ValueError("speculative decoding needs a drafter and num_drafts > 0")
        self.drafter, self.num_drafts = drafter, num_drafts
        self.num_scheduler_steps = num_scheduler_steps
        self.num_multistep_launches = 0  # DECODE steps launched with num_steps > 1
        self.pools = pools
        self.prefill_align = prefill_align
        self.max_prefill_chunks = max_prefill_chunks
        self.prefix = prefix  # None: no prefix cache (--disable-radix-cache)
        self.dp_size = len(pools)
        self.max_running_requests = min(max_running_requests,
                                        *(p.state_pool.num_slots for p in pools))
        self.max_tokens_per_step = max_tokens_per_step
        self.max_logits_rows = max_logits_rows or self.max_running_requests
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.num_retracted_total = 0
        self.num_finished_total = 0
        self.num_aborted_total = 0
        self.num_steps_by_kind: collections.Counter[ForwardMode] = collections.Counter()
        self.num_admitted_per_rank = [0] * self.dp_size  # admissions (re-admissions count again)
        self.num_prefill_tokens_total = 0  # prompt (and re-prefilled) tokens put in prefill chunks
        self.num_cached_tokens_total = 0  # prompt tokens reused from the prefix cache at admission
        # Prefill side of a disaggregated handover: requests with ``export_after_prefill``
        # leave ``running`` once their first token is sampled, still holding pages and slot,
        # until the engine has copied their state out (``release_exported``).
        self.exported: list[Req] = []
        self._loads: list[SnapshotLoad] = []  # the step being scheduled
        self._saves: list[SnapshotSave] = []

    # Queue ---------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args, **limits) -> "Scheduler":
        """The scheduler of a ServerArgs: per-rank pools of ``max_total_tokens`` split over
        the DP ranks, a prefix cache unless it has no GDN snapshots (``--disable-radix-cache``,
        deterministic inference); ``limits``: extra keyword arguments (deterministic limits)."""
        running = args.max_running_requests_per_rank
        pools = RankPools.per_rank(args.dp_size, num_pages=args.max_total_tokens // (
            args.page_size * args.dp_size), page_size=args.page_size, num_slots=running)
        num_snapshots = args.num_gdn_snapshots_per_rank
        prefix = None
        if num_snapshots > 0:
            prefix = PrefixCache([RadixCache(p.page_pool, SnapshotPool(num_snapshots))
                                  for p in pools])
        if args.speculative_algorithm is not None:
            from sglang_tpu_backend.speculative.registry import make_drafter

            limits = dict(drafter=make_drafter(
                args.speculative_algorithm,
                min_window=args.speculative_ngram_min_match_window_size,
                max_window=args.speculative_ngram_max_match_window_size),
                num_drafts=args.speculative_num_drafts, **limits)
        return cls(pools, max_running_requests=running,
                   max_tokens_per_step=args.max_tokens_per_step, prefix=prefix, **limits)

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def running_on(self, rank: int) -> list[Req]:
        return [r for r in self.running if r.dp_rank == rank]

    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """Remove a request wherever it is and free its pages and slot at once."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.abort(message)
                self.num_aborted_total += 1
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                req.abort(message)
                self.num_aborted_total += 1
                return req
        return None

    def fail_all(self, message: str) -> list[Req]:
        """After ``schedule()`` raised: abort every running and waiting request and give back
        the snapshots the unfinished step had planned. Returns the aborted requests.

        ``schedule()`` walks all running requests and the waiting queue, allocating pages,
        slots and prefix-cache locks as it goes; after an exception midway none of those
        requests' bookkeeping can be trusted, and a fault caused by one of them would recur
        on every step. Failing them all leaves the scheduler empty and consistent (requests
        already handed to the handover export path are not the scheduler's to fail)."""
        if self.prefix is not None:
            self.prefix.discard(self._saves)
        self._loads, self._saves = [], []
        failed = []
        for req in list(self.all_requests()):
            if self.abort(req.rid, message) is not None:
                failed.append(req)
        return failed

    # Resources (in the pools of the request's rank) -----------------------------------
    def _ensure_pages(self, req: Req, num_tokens: int) -> bool:
        pool = self.pools[req.dp_rank].page_pool
        need = pages_for(num_tokens, pool.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not pool.can_allocate(need) and self.prefix is not None:
            self.prefix.evict_pages(req.dp_rank, need)
        if not pool.can_allocate(need):
            return False
        req.pages.extend(pool.allocate(need))
        return True

    def _num_spare_pages(self, rank: int) -> int:
        """Free pages of the rank, counting the prefix cache's evictable ones."""
        spare = self.pools[rank].page_pool.num_free
        return spare + (self.prefix.num_evictable_pages(rank) if self.prefix is not None else 0)

    def _tokens_that_fit(self, req: Req, rank: int, n: int, reserve_pages: int = 0,
                         start: int | None = None, num_pages: int | None = None) -> int:
        """Largest ``m <= n`` new tokens after ``start`` (default ``req.num_computed``) whose
        pages rank ``rank`` can give, keeping ``reserve_pages`` free; the request holds
        ``num_pages`` pages (default ``len(req.pages)``)."""
        start = req.num_computed if start is None else start
        num_pages = len(req.pages) if num_pages is None else num_pages
        spare = max(0, self._num_spare_pages(rank) - reserve_pages)
        capacity = (num_pages + spare) * self.pools[rank].page_pool.page_size - start
        return max(0, min(n, capacity))

    def _release(self, req: Req) -> None:
        pools = self.pools[req.dp_rank] if req.dp_rank is not None else None
        if self.prefix is not None and pools is not None:
            self.prefix.release(req)
        elif req.pages:
            pools.page_pool.free(req.pages)
            req.pages = []
        if req.state_slot is not None:
            pools.state_pool.free(req.state_slot)
            req.state_slot = None
        if req in self.running:
            self.running.remove(req)
        req.dp_rank = None

    def _retract(self, req: Req) -> None:
        """Free everything the request holds and requeue it at the front to re-prefill.
        Raises _InFlight instead for a request whose sampled token is not back yet."""
        if req.num_inflight:
            raise _InFlight(req.rid)
        self._release(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.num_retracted_total += 1
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens to re-prefill)", req.rid, req.num_fill)

    def retract_all(self) -> int:
        """Retract every running request (``pause_generation(mode="retract")``), newest first
        so the oldest ends up first in the queue; none may have a token in flight. Returns
        how many were retracted."""
        running = list(self.running)
        for req in reversed(running):
            self._retract(req)
        return len(running)

    # Scheduling ----------------------------------------------------------------------
    def _chunk(self, req: Req, n: int) -> ScheduledChunk:
        start = req.num_computed
        final = start + n == req.num_fill
        sample = final and req.num_sampled < req.max_new_tokens
        if req.input_logprob_rows(start, n):
            logits = "all"
        elif sample:
            logits = "last"
        else:
            logits = "none"
        return ScheduledChunk(req=req, start=start, num_tokens=n, sample=sample, logits=logits,
                              pages=list(req.pages), state_slot=req.state_slot,
                              dp_rank=req.dp_rank)

    def _limit_chunk(self, req: Req, n: int, rows_left: int, start: int | None = None) -> int:
        """Shrink a prefill chunk after ``start`` (default ``req.num_computed``): to the logits
        rows left when it needs one per token, and to end at a GDN snapshot point."""
        start = req.num_computed if start is None else start
        if n > 0 and req.input_logprob_rows(start, n):
            n = min(n, rows_left)
        if n > 0 and self.prefix is not None:
            n = self.prefix.limit_chunk(req, start, n)
        a = self.prefill_align
        if a is not None and 0 < n and start + n < req.num_fill:
            n = max(0, (start + n) // a * a - start)  # end on the grid, or wait for budget
        return n

    def _prefill_chunk(self, req: Req, n: int, step: RankStep) -> ScheduledChunk:
        chunk = self._chunk(req, n)
        self.num_prefill_tokens_total += n
        if self.prefix is not None:
            self.prefix.plan_save(req, chunk.start, n, self._saves)
        step.budget -= n
        step.rows_left -= {"all": n, "last": 1, "none": 0}[chunk.logits]
        step.num_prefill += 1
        if self.max_prefill_chunks is not None and step.num_prefill >= self.max_prefill_chunks:
            step.budget = 0  # the step's (fixed) request rows are taken
        return chunk

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's chunks (allocating their pages), or None when idle.

        Also None when making room would retract a request with a token in flight (overlap
        scheduling): the caller first completes the running step, then schedules again."""
        try:
            while True:
                batch = self._try_schedule()
                if batch is not None or not (self.running or self.waiting):
                    return batch
                if not self.running:
                    # Only possible right after retracting everything: now admission may proceed.
                    return self._try_schedule()
                # Running requests exist but none could get pages: make room (newest request).
                self._retract(self.running[-1])
        except _InFlight:
            return None

    def on_launch(self, batch: ScheduledBatch) -> None:
        """The step is on its way: its tokens count as computed and each sampling chunk's
        token as in flight until :meth:`process_result` brings it back."""
        for c in batch.chunks:
            if c.req.finished or c.req not in self.running:
                continue  # aborted since it was scheduled
            c.req.num_computed = c.start + (1 if c.is_verify else c.num_tokens + batch.num_steps - 1)
            if c.sample:
                c.req.num_inflight += batch.num_steps

    def _try_schedule(self) -> ScheduledBatch | None:
        self._loads, self._saves = [], []
        retracted_before = self.num_retracted_total
        chunks = self._schedule_decodes()
        steps = [RankStep(self.max_tokens_per_step, self.max_logits_rows)
                 for _ in range(self.dp_size)]
        # Decodes drop out of a step with prefill (deterministic mode, speculative decoding).
        separate = self.prefill_align is not None or self.num_drafts > 0
        for c in chunks if not separate else ():
            steps[c.dp_rank].budget -= 1
            steps[c.dp_rank].rows_left -= 1
        num_decodes = len(chunks)
        chunks += self._schedule_prefills(steps)
        chunks += self._admit_waiting(steps, retracted_before)
        if separate and 0 < num_decodes < len(chunks):
            chunks, num_decodes = chunks[num_decodes:], 0  # their pages stay for the next step
        if not chunks:
            return None
        if num_decodes == len(chunks) and self.num_drafts and self._add_drafts(chunks):
            kind = ForwardMode.TARGET_VERIFY
        elif num_decodes == len(chunks):
            kind = ForwardMode.DECODE
        elif num_decodes == 0:
            kind = ForwardMode.EXTEND
        else:
            kind = ForwardMode.MIXED
        self.num_steps_by_kind[kind] += 1
        n = multistep_policy.num_steps(chunks, kind, self.num_scheduler_steps, self.pools)
        self.num_multistep_launches += n > 1
        return ScheduledBatch(chunks, kind, self._loads, self._saves, num_steps=n)

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        """1. Decodes, oldest first; retract the newest requests of the same rank when its
        pages run out."""
        chunks = []
        for req in [r for r in self.running if r.is_decode_ready]:
            if req not in self.running:
                continue  # retracted below for an older request
            while not self._ensure_pages(req, req.num_computed + 1 + self.num_drafts):
                victim = self.running_on(req.dp_rank)[-1]
                self._retract(victim)
                if victim is req:
                    break
            else:
                if multistep_policy.multistep_ok(req, self.num_scheduler_steps):  # N positions' pages
                    self._ensure_pages(req, req.num_computed + self.num_scheduler_steps)
                chunks.append(self._chunk(req, 1))
        return chunks

    def _add_drafts(self, chunks: list[ScheduledChunk]) -> bool:
        """Turn a step's decode chunks into verify chunks: each request's last token and k
        drafts (the drafter's, padded with the last token). A request the drafter proposed
        nothing for verifies its last token only (``accept_drafts`` False: its padding is not
        counted as drafts). False, the chunks left as decodes, when too few requests have
        drafts."""
        k = self.num_drafts
        proposed = self.drafter.propose([c.req for c in chunks], k)
        num_drafted = sum(1 for d in proposed if d)
        if num_drafted == 0 or num_drafted < MIN_DRAFTED_FRACTION * len(chunks):
            return False
        for c, drafts in zip(chunks, proposed):
            last = c.req.fill_slice(c.start, 1)[0]
            drafts = [int(t) for t in drafts][:k]
            c.drafts = drafts + [last] * (k - len(drafts))
            c.accept_drafts = bool(drafts)
            c.num_tokens, c.logits = 1 + k, "all"
        return True

    def _schedule_prefills(self, steps: list[RankStep]) -> list[ScheduledChunk]:
        """2. Running requests in the middle of a (chunked) prefill."""
        chunks = []
        for req in self.running:
            step = steps[req.dp_rank]
            step.running += 1
            if req.is_decode_ready:  # admission keeps pages for the running decodes
                page_size = self.pools[req.dp_rank].page_pool.page_size
                step.reserve += pages_for(1 + self.num_drafts, page_size)
            if (step.budget <= 0 or step.rows_left <= 0 or req.is_decode_ready
                    or req.num_inflight or req.num_pending <= 0):
                continue  # (a request with a token in flight only ever decodes)
            n = self._tokens_that_fit(req, req.dp_rank, min(req.num_pending, step.budget))
            n = self._limit_chunk(req, n, step.rows_left)
            if n > 0 and self._ensure_pages(req, req.num_computed + n):
                chunks.append(self._prefill_chunk(req, n, step))
        return chunks

    def _admit_waiting(self, steps: list[RankStep], retracted_before: int) -> list[ScheduledChunk]:
        """3. Admit waiting requests (FIFO), each on the least-loaded rank that can take it
        (with a prefix cache: on the rank with the longest cached prefix); none in a step
        that retracted (no thrash)."""
        chunks = []
        i = 0
        while i < len(self.waiting) and self.num_retracted_total == retracted_before:
            req = self.waiting[i]
            if self.prefix is not None and self.prefix.should_wait(req, self.running):
                i += 1  # a running request is prefilling its prompt's prefix: reuse it later
                continue
            fits = self._fits(req, steps)
            if not fits:
                break
            best = max(m.length if m else 0 for _, m in fits.values())
            cands = [k for k, (_, m) in fits.items() if (m.length if m else 0) == best]
            if len(cands) == 1:
                k = cands[0]
            else:
                k = pick_rank(cands, [rank_load(p, self.running_on(r))
                                      for r, p in enumerate(self.pools)])
            del self.waiting[i]
            chunks.append(self._admit(req, k, *fits[k], steps[k]))
        return chunks

    def _fits(self, req: Req, steps: list[RankStep]) -> dict:
        """rank -> (tokens of ``req``'s first chunk there, prefix match or None), for every
        rank that can take it now."""
        fits = {}
        for k, step in enumerate(steps):
            if (step.budget <= 0 or step.rows_left <= 0
                    or step.running >= self.max_running_requests
                    or not self.pools[k].state_pool.can_allocate()):
                continue
            m = self.prefix.match(req, k) if self.prefix is not None else None
            start = m.length if m else req.num_computed
            n = self._tokens_that_fit(
                req, k, min(req.num_fill - start, step.budget),
                step.reserve + (m.num_unlocked_pages if m else 0), start=start,
                num_pages=len(m.pages) if m else None)
            n = self._limit_chunk(req, n, step.rows_left, start=start)
            if n > 0:
                fits[k] = (n, m)
        return fits

    def _admit(self, req: Req, k: int, n: int, m, step: RankStep) -> ScheduledChunk:
        """Admit ``req`` on rank ``k`` (a state slot, the prefix match ``m``'s pages) with a
        first chunk of ``n`` tokens."""
        req.dp_rank = k
        req.state_slot = self.pools[k].state_pool.allocate()
        if req.admit_time is None:
            req.admit_time = time.monotonic()
        self.running.append(req)
        self.num_admitted_per_rank[k] += 1
        step.running += 1
        if m is not None:
            self.prefix.admit(req, k, m, self._loads)
            self.num_cached_tokens_total += m.length
        if not self._ensure_pages(req, req.num_computed + n):  # checked in _fits
            raise RuntimeError("page accounting error")
        return self._prefill_chunk(req, n, step)

    # Results -------------------------------------------------------------------------
    def process_result(self, batch: ScheduledBatch, results: list[ChunkResult]) -> list[Req]:
        """Advance each chunk's request; returns requests with new output or newly finished.

        Requests aborted while the step ran are skipped (their resources are already free).
        """
        touched: list[Req] = []
        now = time.monotonic()
        if self.prefix is not None and batch.state_saves:
            self.prefix.commit(batch.state_saves, self.running)
        for chunk, res in zip(batch.chunks, results):
            req = chunk.req
            if chunk.sample:
                req.num_inflight = max(0, req.num_inflight - batch.num_steps)
            if req.finished or req not in self.running:
                continue
            if not chunk.is_verify:  # (no on_launch)
                req.num_computed = max(req.num_computed,
                                       chunk.start + chunk.num_tokens + batch.num_steps - 1)
            if res.routed_experts is not None:
                append_rows(req, res.routed_start, res.routed_experts)
            if res.input_logprobs:
                req.input_logprobs.extend(res.input_logprobs)
                req.input_top_logprobs.extend(res.input_top_logprobs or [[] for _ in res.input_logprobs])
            if chunk.sample:
                run = res.run if res.run is not None else [(res.next_token, res.logprob,
                                                            res.top_logprobs)]
                appended = self._append_tokens(req, run, now)
                if res.drafts is not None:  # NEXTN: what the next verify step checks
                    req.draft_state = res.drafts
                if chunk.is_verify:
                    self._after_verify(req, chunk, res, appended)
                touched.append(req)
            elif (chunk.start + chunk.num_tokens == req.num_fill
                  and len(req.output_ids) >= req.max_new_tokens):  # its last chunk, not just any
                # Prompt-only request (max_new_tokens == 0): done after the prefill.
                req.finish_reason = {"type": "length", "length": req.max_new_tokens}
                req.update_text()
                touched.append(req)
            if req.finished:
                self._release(req)
                self.num_finished_total += 1
            elif chunk.sample and req.export_after_prefill:
                self.running.remove(req)
                self.exported.append(req)
        return touched

    @staticmethod
    def _append_tokens(req: Req, run: list, now: float) -> int:
        """Append sampled (token, logprob, top logprobs) in order, checking the finish
        conditions (EOS, stop ids and strings, lengths) after each: tokens after the one
        that finishes the request are dropped, as sequential decoding never makes them.
        The text is decoded after each token only where a stop string may end the run, else
        once per run (one decode for a multi-step launch's N tokens). Returns the count."""
        per_token = bool(req.sampling.stop)
        for i, (tok, logprob, top) in enumerate(run):
            req.output_ids.append(int(tok))
            if req.return_logprob:
                req.output_logprobs.append(logprob)
                req.output_top_logprobs.append(top or [])
            if req.grammar is not None:
                req.grammar.accept(int(tok))
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            req.check_token_finish()
            if per_token or req.finished:
                req.update_text()
            if req.finished:
                return i + 1
        if not per_token:
            req.update_text()
        return len(run)

    def _after_verify(self, req: Req, chunk: ScheduledChunk, res: ChunkResult,
                      appended: int) -> None:
        """A verify step kept its last token and ``res.num_accepted`` drafts in the cache:
        advance ``num_computed`` and give back the pages reserved past the new sequence."""
        req.spec_verify_ct += 1
        req.spec_verify_tokens += appended
        req.num_computed = chunk.start + 1 + res.num_accepted
        if req.finished:
            return  # released below
        pool = self.pools[req.dp_rank].page_pool
        keep = max(pages_for(req.num_fill, pool.page_size), req.num_shared_pages)
        if len(req.pages) > keep:
            pool.free(req.pages[keep:])
            del req.pages[keep:]

    # Handover (disaggregated prefill / decode) -------------------------------------------
    def release_exported(self, req: Req) -> None:
        """Free an exported request's pages and slot (its state has been copied out)."""
        self.exported.remove(req)
        self.running.append(req)  # _release expects it there
        self._release(req)

    def admit_installed(self, req: Req) -> bool:
        """Admit a request whose first ``req.num_computed`` tokens were computed elsewhere
        (decode side of a handover) on the least-loaded DP rank with room for it: a state slot
        and ``pages_for(num_computed)`` pages, or False (nothing taken) when no rank has them
        now. The request owns all its pages (the prefix cache never shares them); it is
        decode-ready on return."""
        cands = [k for k, p in enumerate(self.pools)
                 if len(self.running_on(k)) < self.max_running_requests
                 and p.state_pool.can_allocate()
                 and self._tokens_that_fit(req, k, req.num_computed, start=0, num_pages=0)
                 >= req.num_computed]
        if not cands:
            return False
        k = pick_rank(cands, [rank_load(p, self.running_on(r)) for r, p in enumerate(self.pools)])
        req.dp_rank = k
        if not self._ensure_pages(req, req.num_computed):
            req.dp_rank = None
            return False
        req.state_slot = self.pools[k].state_pool.allocate()
        req.admit_time = req.admit_time or time.monotonic()
        self.running.append(req)
        self.num_admitted_per_rank[k] += 1
        return True

    def all_requests(self) -> Iterable[Req]:
        yield from self.running
        yield from self.waiting
