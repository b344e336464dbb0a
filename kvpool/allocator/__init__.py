"""Allocators. Modules inside this package import each other by module path (never through
this __init__), so the import order of the package cannot create cycles."""

from kvpool.allocator.base import Allocator
from kvpool.allocator.paged import PagedAllocator, TokenAllocator
from kvpool.allocator.slots import StateSlotAllocator
from kvpool.allocator.swa import SWAAllocator

__all__ = ["Allocator", "PagedAllocator", "TokenAllocator", "StateSlotAllocator", "SWAAllocator"]
