"""GDN state-slot allocator: one conv + recurrent state slot per running request."""

from __future__ import annotations


class StatePool:
    """Owns which state slots ``[0, num_slots)`` are free."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free GDN state slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} freed but not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def reset(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._used.clear()
