"""Disaggregated prefill / decode inside one engine: prefill export and decode install.

Prefill side: a request created with ``export_after_prefill`` stops after its first token;
right after that step the loop copies its KV pages and GDN states out
(``ModelRunner.export_request_state``) into a ``RequestHandover``, frees its pages and slot
(with a prefix cache, the prompt stays cached) and hands the handover to its consumer.

Decode side: a ``RequestHandover`` computed with the weights this engine serves (else it
ends with an abort) waits in ``pending`` until the scheduler admits it on the least-loaded
DP rank with room (pages and a slot owned by the request alone, never shared with the prefix
cache); the loop then scatters its arrays into that rank's pools and the request decodes to
the end. Under NEXTN both sides run the MTP layers: the handover also carries the request's
MTP KV pages and first drafts, installed with its state (its first step verifies them); a
NEXTN decode replica refuses (aborts) a handover without them. One that waits longer
than ``--handover-wait-timeout`` ends with finish_reason abort (the prefill replica has
already freed its copy). A request with ``return_routed_experts`` carries the prompt's routed
expert ids: the decode side's request starts with them (``Req.resume_from``) and they are
written into its store at the installed pages (``RoutedExpertsStore.install``), so its final
``meta_info["routed_experts"]`` is the colocated engine's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.model_executor.routed_experts import request_rows

logger = logging.getLogger(__name__)


class HandoverManager:
    """The handovers of one engine; its methods run on the loop thread unless noted.

    Args:
      loop: the engine's ``SchedulerLoop`` (lock, scheduler, delivery, metrics).
      runner: ``ModelRunner`` (state export / install).
      page_size: the engine's KV page size in tokens.
      wait_timeout: seconds a handover may wait for room before it is aborted.
    """

    def __init__(self, loop: Any, runner: Any, *, page_size: int, wait_timeout: float):
        self.loop, self.runner = loop, runner
        self.page_size, self.wait_timeout = page_size, wait_timeout
        self.pending: list[tuple[Req, RequestHandover]] = []  # waiting for room
        self._installing: list[Req] = []  # admitted, state not installed yet

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    @property
    def next_deadline(self) -> float | None:
        """``time.monotonic()`` at which the oldest waiting handover times out (None: none waits)."""
        if not self.pending:
            return None
        return min(self._deadline(req) for req, _ in self.pending)

    def _deadline(self, req: Req) -> float:
        return req.arrival_time + self.wait_timeout

    # Decode side -----------------------------------------------------------------------------
    def queue_install(self, req: Req, h: RequestHandover) -> None:
        """Any thread, lock held: ``req`` (built from ``h.request``) waits for room; or ends
        with an abort when ``h`` was computed with other weights than this engine serves."""
        version = self.loop.weights.version
        if h.weight_version != version:
            self.loop.metrics.observe_handover(0.0, 0, ok=False)
            req.abort(f"the prefill replica ran weight_version {h.weight_version!r}, this decode "
                      f"replica serves {version!r}: its KV cache cannot be continued here")
            self.loop.delivery.deliver_final(req)
            return
        if self.runner.nextn is not None and h.mtp_kv is None:
            self.loop.metrics.observe_handover(0.0, 0, ok=False)
            req.abort("this decode replica drafts with NEXTN: the handover must carry the MTP KV "
                      "cache (run the prefill replica with --speculative-algorithm NEXTN too)")
            self.loop.delivery.deliver_final(req)
            return
        store = self.runner.routed
        if req.return_routed_experts and store is not None and (
                h.routed_experts.shape[1:] != (store.num_layers, store.top_k)):
            self.loop.metrics.observe_handover(0.0, 0, ok=False)
            req.abort(f"the handover's routed experts are [tokens, moe_layers, top_k] = "
                      f"{list(h.routed_experts.shape)}, this replica's model routes "
                      f"[{store.num_layers}, {store.top_k}] (another model?)")
            self.loop.delivery.deliver_final(req)
            return
        self.pending.append((req, h))

    def install_pending(self) -> None:
        """Admit waiting handovers while pages and slots allow, install their states."""
        loop = self.loop
        with loop.lock:
            now = time.monotonic()
            for req, h in [x for x in self.pending if now > self._deadline(x[0])]:
                self.pending.remove((req, h))
                loop.metrics.observe_handover(0.0, 0, ok=False)
                req.abort(f"no KV pages / state slot free on the decode replica within "
                          f"{self.wait_timeout:g} s (--handover-wait-timeout)")
                loop.delivery.deliver_final(req)
            admitted = []
            while self.pending and loop.scheduler.admit_installed(self.pending[0][0]):
                admitted.append(self.pending.pop(0))
            self._installing = [req for req, _ in admitted]
        for req, h in admitted:
            try:
                self.runner.install_request_state(h.kv, h.conv, h.rec, req.pages,
                                                  req.state_slot, req, rank=req.dp_rank)
                if self.runner.nextn is not None:
                    self.runner.install_mtp_kv(h.mtp_kv, req.pages, rank=req.dp_rank)
                    req.draft_state = list(h.drafts or [])
                if self.runner.routed is not None and h.routed_experts is not None:
                    self.runner.routed.install(h.routed_experts, req.pages, rank=req.dp_rank)
            except Exception as e:
                logger.exception("handover install failed")
                self._fail_one(req, f"handover install failed: {type(e).__name__}: {e}")
                continue
            finally:
                self._installing.remove(req)
            with loop.lock:
                loop.metrics.observe_handover(max(0.0, time.time() - h.export_time), h.nbytes)

    def _fail_one(self, req: Req, message: str) -> None:
        with self.loop.lock:
            self.loop.metrics.observe_handover(0.0, 0, ok=False)
            if self.loop.scheduler.abort(req.rid, message) is None:
                req.abort(message)
            self.loop.delivery.deliver_final(req)

    def fail_installs(self, message: str) -> None:
        """``install_pending`` raised: end the handovers it was admitting or installing, and
        those waiting behind them (lock held)."""
        for req in self._installing:
            self._fail_one(req, message)
        self._installing = []
        for _ in self.pending:
            self.loop.metrics.observe_handover(0.0, 0, ok=False)
        self.abort_pending(message)

    def abort_pending(self, message: str) -> None:
        """Abort every handover still waiting for room (lock held)."""
        for req, _ in self.pending:
            req.abort(message)
            self.loop.delivery.deliver_final(req)
        self.pending.clear()

    def abort(self, rid: str, message: str) -> bool:
        """Abort the waiting handover of ``rid`` (lock held); False when there is none."""
        for i, (req, _) in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                req.abort(message)
                self.loop.delivery.deliver_final(req)
                return True
        return False

    # Prefill side ----------------------------------------------------------------------------
    def export_finished(self) -> None:
        """Right after a step: copy out the state of requests that stopped after their first
        token and hand it to their consumers; then free their pages and slot."""
        loop = self.loop
        with loop.lock:
            reqs = list(loop.scheduler.exported)
        for req in reqs:
            t0 = time.time()
            try:
                kv, conv, rec = self.runner.export_request_state(req.pages, req.state_slot,
                                                                 rank=req.dp_rank)
                mtp_kv = (None if self.runner.nextn is None
                          else self.runner.export_mtp_kv(req.pages, rank=req.dp_rank))
            except Exception as e:
                logger.exception("handover export failed")
                with loop.lock:
                    loop.scheduler.release_exported(req)
                    loop.metrics.observe_handover(0.0, 0, ok=False)
                    req.abort(f"handover export failed: {type(e).__name__}: {e}")
                    loop.delivery.deliver_final(req)
                continue
            with loop.lock:
                loop.scheduler.release_exported(req)
                h = self._handover(req, kv, conv, rec, t0)
                if mtp_kv is not None:
                    h.mtp_kv, h.drafts = mtp_kv, [int(t) for t in req.draft_state or []]
                item = {"handover": h, "output": loop.delivery.outputs.snapshot(req).materialize(),
                        "meta_info": {"finish_reason": None}}
                loop.delivery.push(req.rid, item)

    def _handover(self, req: Req, kv, conv, rec, export_time: float) -> RequestHandover:
        return RequestHandover(
            request=req.request, prompt_ids=list(req.prompt_ids), output_ids=list(req.output_ids),
            seed=req.seed, num_computed=req.num_computed, page_size=self.page_size,
            kv=kv, conv=conv, rec=rec, weight_version=self.loop.weights.version,
            input_logprobs=list(req.input_logprobs),
            input_top_logprobs=list(req.input_top_logprobs),
            output_logprobs=list(req.output_logprobs),
            output_top_logprobs=list(req.output_top_logprobs), export_time=export_time,
            cached_tokens=req.cached_tokens,
            routed_experts=request_rows(req) if req.return_routed_experts else None)

    def fail_exports(self, message: str) -> None:
        """``export_finished`` raised: end every request still waiting for export (lock held)."""
        loop = self.loop
        for req in list(loop.scheduler.exported):
            loop.scheduler.release_exported(req)
            loop.metrics.observe_handover(0.0, 0, ok=False)
            req.abort(message)
            loop.delivery.deliver_final(req)
