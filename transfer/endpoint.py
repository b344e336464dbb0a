"""PoolEndpoint: a pool and its staging area exposed to one or more transports. The sender and
the receiver are both one; close() unregisters what this endpoint exposed.

    region 0 .. n-1   the pool's buffers, in pool.buffer_descriptors() order
    region n          the staging area (num_slots x slot_bytes)

The pool is anything that is an ExposedPool: our own kvpool.HybridPool, or an engine's KV
memory described as one (kvpool.engine.EnginePool: vLLM's cache tensors).
"""

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import torch

from kvpool.geometry import Component
from kvpool.storage import BufferDescriptor
from transfer.buffers import Buffer, buffers_of
from transfer.config import TransferConfig
from transfer.faults import FaultInjector
from transfer.staging import StagingArea
from transfer.engine_rows import engine_lanes
from transfer.errors import LayoutIncompatible
from transfer.tokens import Lane, pool_lanes
from transfer.transports.base import Exposure, Offer, Transport


class StagingInfo(msgspec.Struct, frozen=True, array_like=True):
    """A receiver's staging area as a sender addresses it (it travels in the registration)."""

    region: int
    slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.region < 0 or self.slots < 1 or self.slot_bytes < 1:
            raise ValueError(f"bad staging area (region {self.region}, {self.slots} x {self.slot_bytes} B)")


class ExposedPool(Protocol):
    """What an endpoint needs of the memory it exposes (HybridPool, kvpool.engine.EnginePool)."""

    config: Any  # PoolConfig-like: model, page_size, tp_size, tp_rank, layout, device, components
    token_rows: bool  # items hold token rows in the model's segment order (transfer.tokens), else
    # an engine's blocks (transfer.engine_rows); an optional `no_rows: str` says why they are not rows

    def buffer_descriptors(self) -> list[BufferDescriptor]: ...
    def exposed_tensors(self) -> dict[Component, list[torch.Tensor]]: ...
    def exposed_placements(self) -> dict[Component, list[tuple[int, int, int, int]]]: ...


class PoolEndpoint:
    def __init__(self, transports: Transport | Sequence[Transport], pool: ExposedPool, config: TransferConfig):
        self.transports = [transports] if isinstance(transports, Transport) else list(transports)
        if not self.transports:
            raise ValueError("an endpoint needs at least one transport")
        self.pool, self.config = pool, config
        self.staging = StagingArea(
            config.staging_slots, config.staging_slot_bytes, config.staging_device or pool.config.device
        )
        descs = pool.buffer_descriptors()
        self.buffers: list[Buffer] = buffers_of(descs)  # the pool as peers address it
        # every component's segments as token rows, for peers of another page size or TP size;
        # none where the pool's items are not rows (`no_rows` says why): it pairs only with
        # peers of its own page size and TP
        pc = pool.config
        self.lanes: dict[Component, tuple[Lane, ...]] = {}
        self.no_rows = getattr(pool, "no_rows", "")
        # why a peer of our TP size must have our page size too (an engine's state in shared pages)
        self.whole_states = getattr(pool, "whole_states", "")
        if not self.no_rows:
            try:
                self.lanes = self.lanes_of(pc.page_size, pc.tp_size, self.buffers, "local")
            except LayoutIncompatible as exc:  # an engine's pages shared with state layers, ...
                if pool.token_rows:
                    raise
                self.no_rows = str(exc)
        self.staging_region = len(descs)
        regions = [(d.ptr, d.nbytes) for d in descs] + [(self.staging.ptr, self.staging.nbytes)]
        self.exposures: dict[str, Exposure] = {}
        try:
            for t in self.transports:
                self.exposures[t.kind] = t.expose(regions)
        except BaseException:
            self.close()
            raise
        # torch tensors per component, for gather and scatter
        self.tensors: dict[Component, list] = pool.exposed_tensors()
        # where each layer lies in an item: (buffer, layer, offset, bytes), for layer-wise streaming
        self.placements: dict[Component, list[tuple[int, int, int, int]]] = pool.exposed_placements()
        self.faults = FaultInjector(config.faults)

    def lanes_of(
        self, page_size: int, tp_size: int, buffers: list[Buffer], side: str
    ) -> dict[Component, tuple[Lane, ...]]:
        """The token-row lanes of a side (ours, or a peer's claimed buffers) holding our model at
        `page_size` and `tp_size` in buffers of our pool's kind: our own pools' segment order
        (transfer.tokens), or an engine's blocks (transfer.engine_rows); LayoutIncompatible
        for buffers that are not so."""
        pc = self.pool.config
        if self.pool.token_rows:
            return pool_lanes(pc.model, page_size, tp_size, pc.layout, buffers, side)
        return engine_lanes(pc.model, page_size, tp_size, buffers, side)

    def offers(self) -> list[Offer]:
        """How peers can reach this endpoint, in our order of preference."""
        return [self.exposures[t.kind].offer() for t in self.transports]

    def unsettled(self) -> int:
        """Bytes given up on that may still land, ours or our peers' into our regions
        (Transport.unsettled)."""
        return sum(t.unsettled() for t in self.transports)

    def staging_info(self) -> StagingInfo:
        return StagingInfo(self.staging_region, self.staging.num_slots, self.staging.slot_bytes)

    def close(self) -> None:
        """Unregister what this endpoint exposed. Call before the pool's memory is freed."""
        exposures, self.exposures = self.exposures, {}
        for e in exposures.values():
            e.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
