"""KV page allocator: page ids ``[0, num_pages)``, a free list, no tensors."""

from __future__ import annotations

from sglang_tpu_backend.mem_cache.id_allocator import IdAllocator


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PagePool(IdAllocator):
    """Owns which KV pages are free. Pages are handed out in any order and freed by id."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        super().__init__(num_pages, "KV page")
        self.num_pages = num_pages
        self.page_size = page_size

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` page ids; raises RuntimeError when fewer are free (check ``can_allocate``)."""
        return self._take(n)

    def free(self, pages: list[int]) -> None:
        """Return pages; raises ValueError on a page that is not allocated (double free)."""
        self._give_back(pages)
