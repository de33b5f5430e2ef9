"""Continuous batching: which requests run in the next step, and bookkeeping of results.

Plain Python (no JAX). One step holds at most ``max_tokens_per_step`` token rows:
every decode-ready request contributes one token, prefill chunks fill what is left
(chunked prefill), new requests are admitted while a state slot, ``max_running_requests``
and KV pages allow. When decodes cannot get a KV page, the newest running requests are
retracted: pages and slot freed, requeued at the front, re-prefilled later.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable

from sglang_tpu_backend.managers.schedule_batch import (
    ChunkResult,
    Req,
    ScheduledBatch,
    ScheduledChunk,
)
from sglang_tpu_backend.mem_cache.page_pool import PagePool, pages_for
from sglang_tpu_backend.mem_cache.state_pool import StatePool
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue, the running list and the two pools."""

    def __init__(
        self,
        page_pool: PagePool,
        state_pool: StatePool,
        *,
        max_running_requests: int,
        max_tokens_per_step: int,
        max_logits_rows: int | None = None,
    ):
        self.page_pool = page_pool
        self.state_pool = state_pool
        self.max_running_requests = min(max_running_requests, state_pool.num_slots)
        self.max_tokens_per_step = max_tokens_per_step
        # Logits rows per step (one per sampling request, one per prompt-logprob row).
        self.max_logits_rows = max_logits_rows or self.max_running_requests
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.num_retracted_total = 0
        self.num_finished_total = 0
        self.num_aborted_total = 0

    # Queue ---------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

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

    # Resources -----------------------------------------------------------------------
    def _ensure_pages(self, req: Req, num_tokens: int) -> bool:
        need = pages_for(num_tokens, self.page_pool.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not self.page_pool.can_allocate(need):
            return False
        req.pages.extend(self.page_pool.allocate(need))
        return True

    def _tokens_that_fit(self, req: Req, n: int, reserve_pages: int = 0) -> int:
        """Largest ``m <= n`` new tokens whose pages can be had, keeping ``reserve_pages`` free."""
        page_size = self.page_pool.page_size
        spare = max(0, self.page_pool.num_free - reserve_pages)
        capacity = (len(req.pages) + spare) * page_size - req.num_computed
        return max(0, min(n, capacity))

    def _release(self, req: Req) -> None:
        if req.pages:
            self.page_pool.free(req.pages)
            req.pages = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
        if req in self.running:
            self.running.remove(req)

    def _retract(self, req: Req) -> None:
        """Free everything the request holds and requeue it at the front to re-prefill."""
        self._release(req)
        req.num_computed = 0
        req.num_retractions += 1
        self.num_retracted_total += 1
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens to re-prefill)", req.rid, req.num_fill)

    # Scheduling ----------------------------------------------------------------------
    def _chunk(self, req: Req, n: int) -> ScheduledChunk:
        start = req.num_computed
        final = start + n == req.num_fill
        sample = final and len(req.output_ids) < req.max_new_tokens
        if req.input_logprob_rows(start, n):
            logits = "all"
        elif sample:
            logits = "last"
        else:
            logits = "none"
        return ScheduledChunk(req=req, start=start, num_tokens=n, sample=sample, logits=logits,
                              pages=list(req.pages), state_slot=req.state_slot)

    def _limit_rows(self, req: Req, n: int) -> int:
        """Shrink a prefill chunk that needs a logits row per token to the rows left."""
        if n > 0 and req.input_logprob_rows(req.num_computed, n):
            return min(n, self._rows_left)
        return n

    def _prefill_chunk(self, req: Req, n: int) -> ScheduledChunk:
        chunk = self._chunk(req, n)
        self._rows_left -= {"all": n, "last": 1, "none": 0}[chunk.logits]
        return chunk

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's chunks (allocating their pages), or None when idle."""
        while True:
            batch = self._try_schedule()
            if batch is not None or not (self.running or self.waiting):
                return batch
            if not self.running:
                # Only possible right after retracting everything: now admission may proceed.
                return self._try_schedule()
            # Running requests exist but none could get pages: make room.
            self._retract(self.running[-1])

    def _try_schedule(self) -> ScheduledBatch | None:
        chunks: list[ScheduledChunk] = []
        retracted_before = self.num_retracted_total
        # 1. Decodes, oldest first; retract the newest requests when pages run out.
        for req in [r for r in self.running if r.is_decode_ready]:
            if req not in self.running:
                continue  # retracted below for an older request
            while not self._ensure_pages(req, req.num_computed + 1):
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    break
            else:
                chunks.append(self._chunk(req, 1))
        num_decodes = len(chunks)
        budget = self.max_tokens_per_step - num_decodes
        self._rows_left = self.max_logits_rows - num_decodes
        # 2. Running requests in the middle of a (chunked) prefill.
        for req in self.running:
            if budget <= 0 or self._rows_left <= 0:
                break
            if req.is_decode_ready or req.num_pending <= 0:
                continue
            n = self._limit_rows(req, self._tokens_that_fit(req, min(req.num_pending, budget)))
            if n > 0 and self._ensure_pages(req, req.num_computed + n):
                chunks.append(self._prefill_chunk(req, n))
                budget -= n
        # 3. Admit waiting requests (FIFO), keeping a page per running decode in reserve.
        reserve = sum(1 for r in self.running if r.is_decode_ready)
        while (
            self.waiting
            and self.num_retracted_total == retracted_before  # no re-admission thrash
            and budget > 0
            and self._rows_left > 0
            and len(self.running) < self.max_running_requests
            and self.state_pool.can_allocate()
        ):
            req = self.waiting[0]
            n = self._tokens_that_fit(req, min(req.num_pending, budget), reserve_pages=reserve)
            n = self._limit_rows(req, n)
            if n <= 0:
                break
            self.waiting.popleft()
            req.state_slot = self.state_pool.allocate()
            if req.admit_time is None:
                req.admit_time = time.monotonic()
            self.running.append(req)
            if not self._ensure_pages(req, req.num_computed + n):  # cannot fail: checked above
                raise RuntimeError("page accounting error")
            chunks.append(self._prefill_chunk(req, n))
            budget -= n
        if not chunks:
            return None
        if num_decodes == len(chunks):
            kind = ForwardMode.DECODE
        elif num_decodes == 0:
            kind = ForwardMode.EXTEND
        else:
            kind = ForwardMode.MIXED
        return ScheduledBatch(chunks=chunks, kind=kind)

    # Results -------------------------------------------------------------------------
    def process_result(self, batch: ScheduledBatch, results: list[ChunkResult]) -> list[Req]:
        """Advance each chunk's request; returns requests with new output or newly finished.

        Requests aborted while the step ran are skipped (their resources are already free).
        """
        touched: list[Req] = []
        now = time.monotonic()
        for chunk, res in zip(batch.chunks, results):
            req = chunk.req
            if req.finished or req not in self.running:
                continue
            req.num_computed = chunk.start + chunk.num_tokens
            if res.input_logprobs:
                req.input_logprobs.extend(res.input_logprobs)
                req.input_top_logprobs.extend(res.input_top_logprobs or [[] for _ in res.input_logprobs])
            if chunk.sample:
                req.output_ids.append(int(res.next_token))
                if req.return_logprob:
                    req.output_logprobs.append(res.logprob)
                    req.output_top_logprobs.append(res.top_logprobs or [])
                if req.grammar is not None:
                    req.grammar.accept(int(res.next_token))
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
                req.check_token_finish()
                req.update_text()
                touched.append(req)
            elif req.num_pending == 0 and len(req.output_ids) >= req.max_new_tokens:
                # Prompt-only request (max_new_tokens == 0): done after the prefill.
                req.finish_reason = {"type": "length", "length": req.max_new_tokens}
                req.update_text()
                touched.append(req)
            if req.finished:
                self._release(req)
                self.num_finished_total += 1
        return touched

    def all_requests(self) -> Iterable[Req]:
        yield from self.running
        yield from self.waiting
