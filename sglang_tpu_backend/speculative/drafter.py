"""Where drafts come from: the ``Drafter`` protocol the scheduler calls once per verify step.

Plain Python (no JAX). A drafter proposes, for each decode-ready request of the step, up to
``k`` chain drafts: tokens it guesses follow the request's sequence (prompt + output ids).
Fewer than ``k`` is allowed; the scheduler pads the rest, and a padded draft is
simply rejected unless the target happens to agree with it, which is then as correct as any
accepted draft. A request with no drafts at all verifies its last token only. Per-request drafter state may live in ``req.draft_state`` (it dies with the
request and survives retraction, which keeps the sequence).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from sglang_tpu_backend.managers.schedule_batch import Req


class Drafter(Protocol):
    """Proposes chain drafts for the requests of a verify step."""

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        """At most ``k`` draft token ids per request, in ``reqs``' order."""
        ...


class CallbackDrafter:
    """Drafts from ``fn(req, k) -> list[int]``: a draft source for tests and experiments (a
    model's own greedy continuation with a wrong token at a chosen position, a replay)."""

    def __init__(self, fn: Callable[[Req, int], list[int]]):
        self.fn = fn

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        return [list(self.fn(req, k))[:k] for req in reqs]


def make_drafter(algorithm: str, *, min_window: int, max_window: int) -> Drafter:
    """The drafter of ``--speculative-algorithm`` (validated by ``ServerArgs``)."""
    if algorithm == "NGRAM":
        from sglang_tpu_backend.speculative.ngram import NgramDrafter

        return NgramDrafter(min_window, max_window)
    if algorithm in ("NEXTN", "EAGLE"):
        from sglang_tpu_backend.speculative.nextn import NextnDrafter

        return NextnDrafter()
    raise ValueError(f"no drafter for --speculative-algorithm {algorithm}")
