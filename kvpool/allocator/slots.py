"""Slot allocator: hands out ids 1..capacity from a free stack; id 0 is the sentinel."""

import numpy as np

from kvpool.allocator.base import Allocator
from kvpool.errors import AllocatorError, OutOfSpace
from kvpool.indices import INDEX_DTYPE, as_indices


class SlotAllocator(Allocator):
    """O(n) vectorized alloc/free of n ids; `_is_free` makes double frees detectable."""

    def __init__(self, capacity: int, name: str = "slots"):
        if not isinstance(capacity, int) or capacity < 1:
            raise AllocatorError(f"{name}: capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.name = name
        self.clear()

    def clear(self) -> None:
        # Stack top is the end of the array; ids come out in ascending order on a fresh allocator.
        self._stack = np.arange(self.capacity, 0, -1, dtype=INDEX_DTYPE)
        self._top = self.capacity
        self._is_free = np.ones(self.capacity + 1, dtype=bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return self._top

    @property
    def num_free(self) -> int:
        """Free items (pages or slots), whatever unit available_size() reports in."""
        return self._top

    def alloc(self, n: int) -> np.ndarray:
        """n distinct ids (int32, read-only); raises OutOfSpace and takes nothing if short."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise AllocatorError(f"{self.name}: cannot allocate {n!r} items")
        if n > self._top:
            raise OutOfSpace(self.name, int(n), self._top)
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[ids] = False
        ids.setflags(write=False)
        return ids

    def check_owned(self, indices: np.ndarray, what: str = "free") -> np.ndarray:
        """Validate that `indices` are distinct ids currently handed out; return them as int32."""
        ids = as_indices(indices, f"{self.name}.{what}")
        if len(ids) == 0:
            return ids
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi > self.capacity:
            bad = lo if lo < 1 else hi
            kind = "the padding sentinel" if bad == 0 else "not from this allocator"
            raise AllocatorError(f"{self.name}.{what}: index {bad} is {kind} (valid: 1..{self.capacity})")
        already = ids[self._is_free[ids]]
        if len(already):
            raise AllocatorError(f"{self.name}.{what}: index {int(already[0])} is not allocated (double free?)")
        if self._has_duplicates(ids):
            raise AllocatorError(f"{self.name}.{what}: duplicate indices in one call")
        return ids

    def _has_duplicates(self, ids: np.ndarray) -> bool:
        """For ids all currently allocated. Few ids: sort them. Many (relative to capacity):
        mark them free in the bitmap and count, O(capacity) without a sort, then undo."""
        if len(ids) * 32 < self.capacity:
            return len(np.unique(ids)) != len(ids)
        self._is_free[ids] = True
        distinct = np.count_nonzero(self._is_free) - self._top
        self._is_free[ids] = False
        return distinct != len(ids)

    def free(self, indices: np.ndarray) -> None:
        self._release(self.check_owned(indices))

    def _release(self, ids: np.ndarray) -> None:
        """Push validated ids (see check_owned) back on the free stack."""
        n = len(ids)
        self._stack[self._top : self._top + n] = ids[::-1]
        self._top += n
        self._is_free[ids] = True

    def used(self) -> np.ndarray:
        """Ids currently handed out, ascending."""
        mask = ~self._is_free
        mask[0] = False
        return np.flatnonzero(mask).astype(INDEX_DTYPE)

    def check_integrity(self) -> None:
        stack = self._stack[: self._top]
        assert not self._is_free[0], f"{self.name}: sentinel marked free"
        assert len(stack) == 0 or stack.min() >= 1, f"{self.name}: sentinel on the free stack"
        assert len(np.unique(stack)) == len(stack), f"{self.name}: an id is free twice"
        assert self._is_free[stack].all(), f"{self.name}: free stack and free map disagree"
        n_free = int(self._is_free.sum())
        assert n_free == self._top, f"{self.name}: {n_free} marked free, {self._top} on the stack"
        assert n_free + len(self.used()) == self.capacity, f"{self.name}: free + used != capacity"


class StateSlotAllocator(SlotAllocator):
    """One slot per live request (Mamba state, AUX row)."""
