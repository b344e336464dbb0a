"""Index arrays as they leave a pool: int32, 1-D, read-only, padded only with the sentinel.

Page/slot 0 of every pool is a padding sentinel that no allocator hands out; padding an index
array therefore always writes 0, never whatever a reused buffer held before.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kvpool.errors import AllocatorError
from kvpool.geometry import Component

INDEX_DTYPE = np.dtype(np.int32)
SENTINEL = 0


def as_indices(values: Iterable[int] | np.ndarray, what: str = "indices") -> np.ndarray:
    """A fresh read-only int32 1-D array; refuses non-integers and values that overflow int32."""
    arr = np.asarray(values)
    if arr.size == 0:
        out = np.zeros(0, dtype=INDEX_DTYPE)
    else:
        if arr.ndim != 1:
            raise AllocatorError(f"{what}: expected a 1-D array, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise AllocatorError(f"{what}: expected integers, got dtype {arr.dtype}")
        if arr.dtype != INDEX_DTYPE and (
            arr.min() < np.iinfo(INDEX_DTYPE).min or arr.max() > np.iinfo(INDEX_DTYPE).max
        ):
            raise AllocatorError(f"{what}: values do not fit int32")
        out = arr.astype(INDEX_DTYPE, copy=True)
    out.setflags(write=False)
    return out


def padded(indices: np.ndarray, length: int) -> np.ndarray:
    """`indices` followed by SENTINEL up to `length` (a new array; the input is untouched)."""
    if len(indices) > length:
        raise AllocatorError(f"cannot pad {len(indices)} indices to length {length}")
    out = np.full(length, SENTINEL, dtype=INDEX_DTYPE)
    out[: len(indices)] = indices
    return out


def check_range(indices: np.ndarray, num_items: int, what: str) -> None:
    """Every index must name a real item: 1 <= i < num_items (the sentinel is refused too)."""
    if indices.dtype != INDEX_DTYPE:
        raise AllocatorError(f"{what}: index dtype must be int32, got {indices.dtype}")
    if len(indices) and (indices.min() < 1 or indices.max() >= num_items):
        raise AllocatorError(
            f"{what}: indices must lie in [1, {num_items - 1}], got [{indices.min()}, {indices.max()}]"
        )


@dataclass(frozen=True)
class IndexSet:
    """A request's indices per component, each a read-only int32 array:
    FULL and NSA full pages, SWA window pages, MAMBA [state slot], AUX [aux row]."""

    by_component: Mapping[Component, np.ndarray]

    def __getitem__(self, component: Component) -> np.ndarray:
        return self.by_component[component]

    def __contains__(self, component: Component) -> bool:
        return component in self.by_component

    def components(self) -> tuple[Component, ...]:
        return tuple(self.by_component)

    @staticmethod
    def merge(parts: Iterable["IndexSet"]) -> "IndexSet":
        merged: dict[Component, np.ndarray] = {}
        for part in parts:
            merged.update(part.by_component)
        return IndexSet(merged)
