"""A free list over integer ids ``[0, n)``: the bookkeeping shared by the KV page pool and the
GDN state-slot pool. Plain Python, no tensors."""

from __future__ import annotations


class IdAllocator:
    """Hands out free ids (lowest first after a reset) and takes them back by id."""

    def __init__(self, num_ids: int, what: str):
        if num_ids <= 0:
            raise ValueError(f"number of {what}s must be positive, got {num_ids}")
        self.what = what  # e.g. "KV page", used in error messages
        self._num_ids = num_ids
        self._free: list[int] = []
        self._used: set[int] = set()
        self.reset()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def _take(self, n: int) -> list[int]:
        if not 0 <= n <= len(self._free):
            raise RuntimeError(f"cannot allocate {n} {self.what}(s): "
                               f"{len(self._free)} free of {self._num_ids}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def _give_back(self, ids) -> None:
        """Raises ValueError on an id that is not allocated (double free)."""
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.what} {i} freed but not allocated")
            self._used.remove(i)
            self._free.append(i)

    def reset(self) -> None:
        self._free = list(range(self._num_ids - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._used.clear()
