"""A request's stop strings, matched against the tail of its growing output text.

``Req.update_text`` calls :meth:`StopStrings.find` and :meth:`StopStrings.held_back` once per
new piece of text. Both look only at the tail that can still change the answer (the held-back
text plus the new text), so a step's cost does not grow with the output, and the number of
stop strings enters only through one compiled regular expression and a sorted list.
"""

from __future__ import annotations

import bisect
import re


class StopStrings:
    """Non-empty stop strings (the caps are ``sampling_params.MAX_STOP_STRINGS`` /
    ``MAX_STOP_STRING_LEN``), built once per request."""

    def __init__(self, stops: list[str]):
        self.sorted = sorted(set(stops))
        self.max_len = max(map(len, self.sorted), default=0)
        self._first_chars = frozenset(s[0] for s in self.sorted)
        # Alternatives in sorted order: at the leftmost position that matches, the regex engine
        # takes the first alternative that matches there, i.e. the smallest such stop string.
        self._pattern = re.compile("|".join(map(re.escape, self.sorted))) if self.sorted else None

    def find(self, text: str, begin: int) -> tuple[int, str] | None:
        """The stop string occurrence starting at or after ``begin`` with the smallest start
        (then the smallest string): ``(start, stop)``, or None."""
        m = self._pattern.search(text, begin) if self._pattern is not None else None
        return None if m is None else (m.start(), m.group())

    def held_back(self, text: str, at_most: int) -> int:
        """Length ``k`` of the longest tail ``text[-k:]`` that begins some stop string (and is
        shorter than the longest one): text that may still turn into a stop string. Only tails
        of at most ``at_most`` characters are tried; 0 when none begins one."""
        for k in range(min(at_most, self.max_len - 1, len(text)), 0, -1):
            if text[-k] not in self._first_chars:
                continue
            tail = text[-k:]
            i = bisect.bisect_left(self.sorted, tail)  # the first stop >= tail starts with it, if any does
            if i < len(self.sorted) and self.sorted[i].startswith(tail):
                return k
        return 0
