"""Paged allocator: whole pages of `page_size` tokens; the token allocator is page size 1."""

import numpy as np

from kvpool.allocator.slots import SlotAllocator
from kvpool.errors import AllocatorError
from kvpool.spec import check_page_size


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagedAllocator(SlotAllocator):
    def __init__(self, num_pages: int, page_size: int, name: str = "pages"):
        check_page_size(page_size)
        super().__init__(num_pages, name)
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.capacity

    def available_size(self) -> int:
        """Free tokens (whole pages)."""
        return self._top * self.page_size

    def available_pages(self) -> int:
        return self._top

    def alloc_tokens(self, num_tokens: int) -> np.ndarray:
        """Pages for a new request of `num_tokens` tokens."""
        return self.alloc(num_pages_for(num_tokens, self.page_size))

    def alloc_extend(self, cur_tokens: int, new_tokens: int) -> np.ndarray:
        """Pages needed to grow a request from `cur_tokens` to `new_tokens` tokens."""
        if new_tokens < cur_tokens:
            raise AllocatorError(f"{self.name}: cannot extend from {cur_tokens} down to {new_tokens} tokens")
        return self.alloc(num_pages_for(new_tokens, self.page_size) - num_pages_for(cur_tokens, self.page_size))


class TokenAllocator(PagedAllocator):
    """One token per item (page size 1)."""

    def __init__(self, num_tokens: int, name: str = "tokens"):
        super().__init__(num_tokens, 1, name)
