"""GDN state-slot allocator: one conv + recurrent state slot per running request."""

from __future__ import annotations

from sglang_tpu_backend.mem_cache.id_allocator import IdAllocator


class StatePool(IdAllocator):
    """Owns which state slots ``[0, num_slots)`` are free."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, "GDN state slot")
        self.num_slots = num_slots

    def can_allocate(self) -> bool:
        return self.num_free > 0

    def allocate(self) -> int:
        """One slot; raises RuntimeError when none is free (check ``can_allocate``)."""
        return self._take(1)[0]

    def free(self, slot: int) -> None:
        """Return a slot; raises ValueError on a slot that is not allocated (double free)."""
        self._give_back([slot])
