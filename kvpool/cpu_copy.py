"""CPU copies of a request's KV, for preemption/retraction and restore."""

from dataclasses import dataclass

import numpy as np
import torch

from kvpool.geometry import Component


@dataclass(frozen=True)
class ComponentCopy:
    positions: np.ndarray  # int32: page positions within the request ([0] for slots)
    buffers: tuple[torch.Tensor, ...]  # CPU uint8 [len(positions), item_bytes], one per buffer


@dataclass(frozen=True)
class KVCopy:
    num_tokens: int
    components: dict[Component, ComponentCopy]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for c in self.components.values() for t in c.buffers)
