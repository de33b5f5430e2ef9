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


MISSES_BEFORE_PAUSE = 2  # proposals in a row with nothing accepted before a pause
FIRST_PAUSE, MAX_PAUSE = 4, 64  # decode steps without drafts: 4, 8, 16, ... 64


class DraftGuard:
    """Per-request back-off of a drafter: a request whose drafts keep being rejected stops
    drafting for a while, so its steps can run as plain decode steps (the scheduler runs a
    verify step only when enough of a step's requests have drafts).

    After ``MISSES_BEFORE_PAUSE`` proposals in a row with no draft accepted, the request
    proposes nothing for its next ``pause`` decode steps; each further pause doubles (up to
    ``MAX_PAUSE``), and one accepted draft resets both. Acceptance is read off the sequence
    itself: a verify step appends the accepted drafts and then the target's own token, which
    differs from the first rejected draft, so the accepted count is the common prefix of the
    drafts and the tokens appended after them. A proposal the scheduler dropped (its step ran
    as a plain decode) is judged the same way on the one token the step appended: whether
    its first draft was right.

    pending:  (sequence length when proposed, the drafts) of the last proposal not yet
              judged, or None.
    misses:   judged proposals in a row with no draft accepted.
    skip:     proposals still to skip (the current pause).
    pause:    the length of the next pause.
    accepted_any: whether any proposal had a draft accepted.
    """

    def __init__(self):
        self.pending: tuple[int, list[int]] | None = None
        self.misses, self.skip, self.pause = 0, 0, FIRST_PAUSE
        self.accepted_any = False

    @property
    def judged_from(self) -> int | None:
        """The sequence length the pending proposal was made at (None: nothing pending)."""
        return None if self.pending is None else self.pending[0]

    def judge(self, new: Sequence[int]) -> None:
        """Score the pending proposal against ``new``: the tokens the sequence gained since
        ``judged_from``."""
        if self.pending is None or len(new) == 0:
            return  # nothing pending, or not verified yet
        drafts = self.pending[1]
        self.pending = None
        accepted = next((j for j, (d, t) in enumerate(zip(drafts, new)) if d != t),
                        min(len(drafts), len(new)))
        if accepted:
            self.misses, self.pause, self.accepted_any = 0, FIRST_PAUSE, True
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.misses, self.skip = 0, self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)

    def allow(self) -> bool:
        """Whether to propose this step (consumes one step of a pause)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def may_allow_next(self) -> bool:
        """Whether the next ``allow()`` can return True (no pause under way): NEXTN runs its
        draft chain only for a step some of whose requests may draft next."""
        return self.skip == 0

    def proposed(self, length: int, drafts: list[int]) -> None:
        """Remember ``drafts`` proposed after the first ``length`` tokens, to judge later."""
        if drafts:
            self.pending = (length, list(drafts))


class CallbackDrafter:
    """Drafts from ``fn(req, k) -> list[int]``: a draft source for tests and experiments (a
    model's own greedy continuation with a wrong token at a chosen position, a replay)."""

    def __init__(self, fn: Callable[[Req, int], list[int]]):
        self.fn = fn

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        return [list(self.fn(req, k))[:k] for req in reqs]
