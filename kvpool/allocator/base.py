"""The interface every allocator implements."""

from abc import ABC, abstractmethod

import numpy as np


class Allocator(ABC):
    @abstractmethod
    def available_size(self) -> int:
        """Free capacity in the allocator's unit (tokens for page allocators, slots otherwise)."""

    @abstractmethod
    def free(self, indices: np.ndarray) -> None:
        """Return indices handed out by this allocator. Double frees, the sentinel and foreign
        indices raise AllocatorError and change nothing."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == capacity and the sentinel is never free."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every allocation."""
