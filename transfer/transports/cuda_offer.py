"""What the owner of CUDA memory offers a writer on its host (cuda-ipc): an IPC handle per
region's allocation and the region's offset in it, never an address; and who can use it (the
same host: boot id plus hostname). Only plain cudaMalloc memory can be exported: memory from
expandable segments (VMM) is refused by name."""

import os
from collections.abc import Sequence

import msgspec
import numpy as np

from transfer.errors import TransportError
from transfer.transports.base import Exposure, Offer
from transfer.transports.cuda_driver import Driver
from transfer.transports.host import host_identity

KIND = "cuda-ipc"


def reach_problem(offer: Offer, host: str) -> str | None:
    """None if a cuda-ipc offer can be opened from `host`, else why not."""
    if offer.kind != KIND:
        return f"not {KIND}"
    if offer.host != host:
        return f"{KIND}: the peer is on another host ({offer.host} vs {host})"
    return None


class _Region(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes  # cuIpcGetMemHandle of the allocation holding the region (64 bytes)
    offset: int  # the region's start inside that allocation
    nbytes: int


class Blob(msgspec.Struct, frozen=True, array_like=True):
    pid: int
    regions: list[_Region]


blob_decoder = msgspec.msgpack.Decoder(Blob)


class CudaIpcExposure(Exposure):
    def __init__(self, driver: Driver, regions: Sequence[tuple[int, int]]):
        self.bases = np.array([int(p) for p, _ in regions], dtype=np.int64)
        self.sizes = np.array([int(n) for _, n in regions], dtype=np.int64)
        out = []
        for i, (ptr, nbytes) in enumerate((int(p), int(n)) for p, n in regions):
            if not driver.is_device_memory(ptr):
                raise TransportError(
                    f"cuda-ipc: region {i} ({nbytes} bytes) is not CUDA device memory; "
                    "it needs pools on CUDA (--device cuda or cuda:N)"
                )
            base, size = driver.allocation(ptr)
            if ptr + nbytes > base + size:
                raise TransportError(f"cuda-ipc: region {i} spans more than one allocation")
            out.append(_Region(driver.export(base), ptr - base, nbytes))
        self._blob = msgspec.msgpack.encode(Blob(os.getpid(), out))

    def offer(self) -> Offer:
        return Offer(KIND, host_identity(), self._blob)

    def close(self) -> None:
        pass  # nothing is registered: a handle lives as long as the allocation
