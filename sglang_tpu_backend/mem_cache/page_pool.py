"""KV page allocator: page ids ``[0, num_pages)``, a free list, no tensors."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PagePool:
    """Owns which KV pages are free. Pages are handed out in any order and freed by id."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` page ids; raises RuntimeError when fewer are free (check ``can_allocate``)."""
        if not self.can_allocate(n):
            raise RuntimeError(f"cannot allocate {n} KV pages: {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; raises ValueError on a page that is not allocated (double free)."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"KV page {p} freed but not allocated")
            self._used.remove(p)
            self._free.append(p)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._used.clear()
