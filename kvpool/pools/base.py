"""The one interface every pool class implements, and the shared component-pool machinery.

Signatures are explicit and identical across classes (tests/kvpool/test_conformance.py checks
them with inspect); every request-scoped method takes the RequestKV handle and nothing else.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from kvpool.allocator.swa import SWAAllocator
from kvpool.config import PoolConfig
from kvpool.cpu_copy import ComponentCopy, KVCopy
from kvpool.errors import LayoutMismatch
from kvpool.geometry import Component, segments
from kvpool.indices import IndexSet, as_indices
from kvpool.request import RequestKV
from kvpool.storage import BufferDescriptor, Storage


class KVPool(ABC):
    @abstractmethod
    def buffer_descriptors(self) -> list[BufferDescriptor]:
        """Every buffer to register with a transfer engine."""

    @abstractmethod
    def index_set(self, req: RequestKV) -> IndexSet:
        """What a transfer of `req` moves, per component (SWA: the window pages only)."""

    @abstractmethod
    def get_cpu_copy(self, req: RequestKV) -> KVCopy:
        """Everything `req` holds, copied to CPU memory (SWA: every page still backed)."""

    @abstractmethod
    def load_cpu_copy(self, req: RequestKV, copy: KVCopy) -> None:
        """Write `copy` into the (new) allocation `req`, which must hold the same positions."""

    @abstractmethod
    def layer_view(self, layer: int, part: str) -> torch.Tensor:
        """Typed view [num_items, *shape] of one layer's part, for an engine's kernels."""


class ComponentPool(KVPool):
    """A pool of one component; subclasses say which items a request holds and transfers."""

    component: ClassVar[Component]

    def __init__(self, config: PoolConfig, num_items: int, swa_map: SWAAllocator | None = None):
        """`swa_map`: the HybridPool's full -> SWA page map, for a pool whose items are SWA
        pages (every pool class is built alike: kvpool.pools.hybrid.POOL_CLASSES)."""
        self.config = config
        self.swa_map = swa_map
        segs = segments(config.model, self.component, config.page_size, config.tp_size)
        self.storage = Storage(self.component, segs, config.layout, num_items, config.device)

    @abstractmethod
    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        """(positions within the request, pool items) of everything `req` holds here."""

    @abstractmethod
    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        """Pool items a transfer of `req` moves, in request order."""

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return self.storage.descriptors()

    def index_set(self, req: RequestKV) -> IndexSet:
        return IndexSet({self.component: as_indices(self.transfer_indices(req), self.component.value)})

    def get_cpu_copy(self, req: RequestKV) -> KVCopy:
        positions, items = self.held(req)
        copy = ComponentCopy(as_indices(positions), self.storage.gather(items))
        return KVCopy(req.num_tokens, {self.component: copy})

    def load_cpu_copy(self, req: RequestKV, copy: KVCopy) -> None:
        self.storage.scatter(self.check_copy(req, copy), copy.components[self.component].buffers)

    def check_copy(self, req: RequestKV, copy: KVCopy) -> np.ndarray:
        """Validate that `copy` fits `req` here, changing nothing; return the target items."""
        part = copy.components.get(self.component)
        if part is None:
            raise LayoutMismatch(f"copy has no {self.component.value} component")
        if copy.num_tokens != req.num_tokens:
            raise LayoutMismatch(f"copy of {copy.num_tokens} tokens into a request of {req.num_tokens}")
        positions, items = self.held(req)
        if not np.array_equal(positions, part.positions):
            raise LayoutMismatch(
                f"{self.component.value}: request holds {len(positions)} positions "
                f"{positions.tolist()[:8]}, copy has {len(part.positions)} {part.positions.tolist()[:8]}"
            )
        self.storage.check_data(items, part.buffers)
        return items

    def layer_view(self, layer: int, part: str) -> torch.Tensor:
        return self.storage.view(layer, part)


class FullPagePool(ComponentPool):
    """A component indexed by the request's full pages (FULL, NSA)."""

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(req.num_pages, dtype=np.int32), req.full_pages

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        return req.full_pages


class RequestSlotPool(ComponentPool):
    """A component with one item per request (MAMBA state slot, AUX row)."""

    @abstractmethod
    def slot(self, req: RequestKV) -> int:
        """The request's item in this pool."""

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(1, dtype=np.int32), np.array([self.slot(req)], dtype=np.int32)

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        return np.array([self.slot(req)], dtype=np.int32)
