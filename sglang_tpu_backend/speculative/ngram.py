"""NGRAM drafting: continue a request's sequence the way it went on after the previous
occurrence of its current suffix (prompt lookup; no draft model).

For a sequence ``t[0:L]`` (prompt + output ids) the drafter takes the longest suffix
``t[L-w:L]`` with ``min_window <= w <= max_window`` that also occurs earlier, ending at some
``e < L`` (the latest such occurrence), and proposes ``t[e], t[e+1], ...``. When the copy
reaches the end of the sequence it continues from its own drafts (``t[e+j]`` for ``e+j >= L``
is draft ``e+j-L``), so a sequence repeating a period shorter than ``k`` still gets ``k``
drafts.

Back-off (``drafter.DraftGuard``): a request whose drafts keep being rejected stops drafting
for a while, so its steps can run as plain decode steps. Until one of its drafts has been
accepted a request proposes only on a match of at least ``PROBE_MIN_WINDOW`` tokens: in text
that does not repeat a single token recurs by chance (a 1-token match in a 150-token
sequence over a 1K vocabulary: one step in seven), a 2-token one almost never, and every
such probe costs its batch a verify step.

Cost: each request keeps an ``NgramIndex`` (with its ``DraftGuard``, in ``req.draft_state``)
mapping every n-gram of each window size to its latest end. A step indexes only the tokens
appended since the last step, O(new tokens x windows x max_window) and one dictionary lookup
per window size; nothing is proportional to the sequence length.
"""

from __future__ import annotations

from typing import Sequence

from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.speculative.drafter import DraftGuard

PROBE_MIN_WINDOW = 2  # the shortest match a request proposes on before a draft was accepted


class NgramIndex:
    """The latest end of every n-gram (``min_window..max_window`` tokens) of one growing
    sequence, the current suffix excluded.

    tokens: the sequence as indexed so far (a copy, extended by ``extend``).
    ends:   per window size w, ``tuple(tokens[e-w:e]) -> e`` for the latest end
            ``e <= len(tokens) - 1``.
    """

    def __init__(self, min_window: int, max_window: int):
        self.windows = range(min_window, max_window + 1)
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {w: {} for w in self.windows}

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens`` and index the n-grams that now end before the last token."""
        t = self.tokens
        first_end = max(len(t), 1)  # n-grams ending at 1 .. len-1 were indexed before
        t.extend(int(x) for x in new_tokens)
        for e in range(first_end, len(t)):
            for w in self.windows:
                if w > e:
                    break
                self.ends[w][tuple(t[e - w:e])] = e

    def propose(self, k: int, min_window: int | None = None) -> list[int]:
        """Up to ``k`` drafts after the longest suffix of at least ``min_window`` (default: the
        index's) tokens that occurred before ([] if none did)."""
        t, L = self.tokens, len(self.tokens)
        for w in reversed(self.windows):
            if w > L:
                continue
            if min_window is not None and w < min_window:
                break
            e = self.ends[w].get(tuple(t[L - w:]))
            if e is None:
                continue
            drafts: list[int] = []
            for j in range(k):
                src = e + j
                drafts.append(t[src] if src < L else drafts[src - L])
            return drafts
        return []


class NgramDrafter:
    """``Drafter`` of ``--speculative-algorithm NGRAM``; its per-request state
    (``NgramIndex``, ``DraftGuard``) lives in ``req.draft_state``. A request's proposal is
    [] unless a suffix of at least ``min_window`` tokens (``PROBE_MIN_WINDOW`` before any
    draft of it was accepted) occurred before and its guard is not pausing it."""

    def __init__(self, min_window: int, max_window: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"NGRAM windows need 1 <= min <= max, got {min_window}, {max_window}")
        self.min_window, self.max_window = min_window, max_window

    def propose(self, reqs: Sequence[Req], k: int) -> list[list[int]]:
        out = []
        for req in reqs:
            if not isinstance(req.draft_state, tuple):
                req.draft_state = (NgramIndex(self.min_window, self.max_window), DraftGuard())
            index, guard = req.draft_state
            n = len(req.prompt_ids) + len(req.output_ids)
            index.extend(req.fill_slice(len(index.tokens), n - len(index.tokens)))
            if guard.judged_from is not None:
                guard.judge(index.tokens[guard.judged_from:])
            shortest = (self.min_window if guard.accepted_any
                        else max(self.min_window, PROBE_MIN_WINDOW))
            drafts = index.propose(k, shortest) if guard.allow() else []
            guard.proposed(len(index.tokens), drafts)
            out.append(drafts)
        return out
