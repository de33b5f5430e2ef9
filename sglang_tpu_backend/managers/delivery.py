"""Delivery of outputs from the loop thread to each request's consumer.

A consumer (one ``generate_request`` iterator, on some asyncio event loop) registers an
``asyncio.Queue`` under its request id; the loop thread pushes items into it with
``call_soon_threadsafe``. Every method runs with the engine lock held.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sglang_tpu_backend.managers.output_builder import OutputBuilder
from sglang_tpu_backend.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class Delivery:
    """rid -> (event loop, queue) of the consumers, and what is pushed to them.

    Args:
      outputs: builds the SGLang output snapshots.
      metrics: ``EngineMetrics``; ``on_finish`` is called once per finished request.
      stream_interval: a streaming request gets an output every this many new tokens.
    """

    def __init__(self, outputs: OutputBuilder, metrics: Any, stream_interval: int):
        self.outputs = outputs
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._consumers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def register(self, rid: str, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self._consumers[rid] = (loop, queue)

    def unregister(self, rid: str) -> None:
        self._consumers.pop(rid, None)

    def has_consumer(self, rid: str) -> bool:
        return rid in self._consumers

    def push(self, rid: str, item: Any) -> bool:
        """Put ``item`` into ``rid``'s queue; False when it has no consumer (or its event loop
        is closed)."""
        target = self._consumers.get(rid)
        if target is None:
            return False
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            return False
        return True

    def deliver(self, reqs: list[Req]) -> None:
        """Push each request's output if it is due: a finished request's final output once,
        a streaming request's every ``stream_interval`` new tokens."""
        for req in reqs:
            if req.finished:
                if req.final_delivered:
                    continue
                self.metrics.on_finish(req)
            if not self.has_consumer(req.rid):
                req.final_delivered = req.finished
                continue
            if not req.finished and (not req.stream or len(req.output_ids) - req.num_sent_tokens
                                     < self.stream_interval):
                continue
            req.num_sent_tokens = len(req.output_ids)
            snapshot = self.outputs.snapshot(req)
            req.final_delivered = req.finished
            self.push(req.rid, snapshot)

    def deliver_final(self, req: Req) -> None:
        """Deliver a finished request's final output, once; falls back to a bare output when
        building the full one fails (the consumer must not wait forever)."""
        if req.final_delivered:
            return
        try:
            self.deliver([req])
        except Exception:
            logger.exception("building the final output of %s failed", req.rid)
            req.final_delivered = True
            self.push(req.rid, self.outputs.final_fallback(req))
