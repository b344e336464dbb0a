"""The CUDA IPC transport: prefill writes straight into decode's pool on another GPU of the
same host, over NVLink (or PCIe), with one copy kernel on the prefill GPU.

    decode (owner, cuda_offer.py)                prefill (writer, GPU 0)
      cuIpcGetMemHandle(allocation base)           cuIpcOpenMemHandle once per handle and link
      offer: host id, pid, [(handle, offset        (lazy peer access), closed with the link
              in allocation, nbytes)] per region   prepare_runs (may run while the KV is still
                                                   computed): runs + buffer table -> GPU,
                                                   launches packed
                                                   start: one kernel expands and copies, each
                                                   warp whole ranges, 16-byte vectors where
                                                   aligned; an event marks the end: the
                                                   waiter sleeps through most of the write
                                                   and watches its tail (pace.py)

Addresses never travel: the offer names allocations by IPC handle and offset, the writer maps
them where its driver puts them. A mapping gives no liveness signal (a write after the owner
exited still "succeeds"), so liveness comes from the control plane's heartbeats and epochs,
and the owner never frees pages a writer may still hold (decode's quarantine). Only plain
cudaMalloc memory can be exported: memory from expandable segments (VMM) is refused by name.
The CUDA driver is reached through ctypes (cuda_driver.py); CuPy compiles the kernel (NVRTC).
"""

import argparse
import itertools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from transfer.errors import PeerUnreachable, TransportError, WriteFailed
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, PreparedWrite, Transport
from transfer.transports.ranges import LaneRuns, Ranges, RunSet
from transfer.transports.cuda_copy import RangeCopier, Table, TableCache
from transfer.transports.cuda_fan import FanWriter
from transfer.transports.cuda_layout import Regions, absolute, lay_out, layout_key, work
from transfer.transports.cuda_driver import Call, Driver, Event
from transfer.flag_values import positive_int
from transfer.transports.kind import TransportKind, TransportSettings
from transfer.transports.cuda_offer import KIND, CudaIpcExposure, Blob, blob_decoder, host_identity, reach_problem
from transfer.transports.pace import Pace, Watch

COST = LinkCost(per_range_us=0.0, link_gbps=300.0)  # fragments run at full speed: always direct
_SERIALS = itertools.count(1)  # links' serials: a fan-out's table names the links it was laid out for


class CudaWrite(PendingWrite):
    POLL_S = 100e-6

    def __init__(self, event: Event, nbytes: int, watch: Watch, keep: object = None):
        self._event, self.nbytes, self._watch = event, nbytes, watch
        self._keep = keep  # the pinned table its upload read (done once the write is)

    def poll(self) -> bool:
        return self._event.query()

    def wait(self, timeout: float | None = None) -> None:
        if timeout is None:
            self._watch.wait(self._event)  # sleeps through most of it, watches its tail (pace.py)
            return
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() > deadline:
                raise WriteFailed("write", -2, "cuda-ipc peer", self.nbytes, detail=f"not done within {timeout} s")
            time.sleep(self.POLL_S)


class CudaPrepared(PreparedWrite):
    """A write whose tables are on the device and whose launches are packed: start() queues
    them. It holds its tables (Table.hold) until then, or until it is dropped unstarted."""

    def __init__(self, link: "CudaIpcLink", calls: list[Call], tables: Sequence[Table], nbytes: int):
        self._link, self._calls, self._tables, self.nbytes = link, calls, tuple(tables), nbytes

    def start(self) -> CudaWrite:
        calls, tables = self._take()
        return self._link._start(calls, tables, self.nbytes)

    def _take(self) -> tuple[list[Call], tuple[Table, ...]]:
        """Its launches and tables, once (start, or a chain that takes them over)."""
        if self._calls is None:
            raise RuntimeError("a prepared write starts once")
        calls, tables, self._calls, self._tables = self._calls, self._tables, None, ()
        return calls, tables

    def __del__(self) -> None:  # never started: its tables are not held any more
        for table in getattr(self, "_tables", ()):
            try:
                table.drop()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass


class CudaIpcLink(Link):
    kind = KIND
    cost = COST
    ordered = True  # one stream: a later write starts after an earlier one landed

    def __init__(self, transport: "CudaIpcTransport", local: CudaIpcExposure, blob: Blob):
        import torch

        self._t, self._local, self._pid = transport, local, blob.pid
        self.serial = next(_SERIALS)
        self.peer = f"pid {blob.pid} on this host"
        self._mapped: dict[bytes, int] = {}
        self._lock, self._closed = threading.Lock(), False  # the lock: launches vs close
        bases = []
        torch.cuda.set_device(transport.device)
        try:
            for r in blob.regions:
                if r.handle not in self._mapped:
                    self._mapped[r.handle] = transport.driver.open(r.handle)
                bases.append(self._mapped[r.handle] + r.offset)
        except BaseException:
            self.close()
            raise
        self._bases = np.array(bases, dtype=np.int64)
        self._sizes = np.array([r.nbytes for r in blob.regions], dtype=np.int64)
        self._ours = Regions("source", local.bases, local.sizes)
        self._theirs = Regions(f"destination {self.peer}", self._bases, self._sizes)
        self._stream = torch.cuda.Stream(transport.device)
        self._pace, self._last = Pace(COST.link_gbps), None  # the stream's clock; its last write's event
        self._tables = TableCache(transport.driver)  # this link's kernel tables by runsets (its stream's)

    def _start(self, calls: list[Call], tables: Sequence[Table], nbytes: int) -> CudaWrite:
        try:
            return self._launch(calls, tables, nbytes)
        finally:
            for table in tables:
                table.drop()  # queued (stream order protects it from here on), or never will be

    def _launch(self, calls: list[Call], tables: Sequence[Table], nbytes: int) -> CudaWrite:
        driver, stream = self._t.driver, self._stream.cuda_stream
        with self._lock:
            if self._closed:  # its mappings are gone: a kernel would write into unmapped memory
                raise PeerUnreachable("write", -1, self.peer, detail="the link is closed")
            with driver.current(self._t.copier.context()):
                alone = self._last is None or self._last.query()  # nothing of ours still runs
                started = time.perf_counter()
                try:
                    for call in calls:
                        call.launch(stream)
                    event = driver.event()
                    event.record(stream)
                except BaseException:  # kernels queued before the failure still read the table:
                    try:  # let them finish before it can be reused
                        driver.synchronize_stream(stream)
                    except TransportError:
                        pass
                    raise
            self._last = event
            watch = Watch(self._pace, nbytes, started, self._pace.queued(nbytes, started, alone), alone)
        return CudaWrite(event, nbytes, watch, tuple(t.host for t in tables))

    def write_async(self, ranges: Ranges) -> CudaWrite:
        flat = absolute(ranges, self._ours, self._theirs)  # (checked here: a staged chunk's one range)
        return self._prepare([[flat[0]]], lambda: [[flat]], flat=True).start()

    def prepare_runs(self, runsets: Sequence[RunSet | LaneRuns]) -> CudaPrepared:
        return self.prepare_chain([runsets])

    def prepare_chain(self, groups: Sequence[Sequence[RunSet | LaneRuns]]) -> CudaPrepared:
        """The groups as one write with one table (one upload, or none when the same runsets
        were prepared before: TableCache), each group's launches after the previous group's."""
        return self._prepare(groups, lambda: [work(g, self._ours, self._theirs) for g in groups])

    def _prepare(self, groups, checked, flat: bool = False) -> CudaPrepared:
        """A write of `groups` of runsets: the table laid out for them before, or `checked()`
        (the groups as kernel work, every range checked against both sides' regions: raises
        OutOfBounds) laid out, uploaded and cached."""
        if self._closed:
            raise PeerUnreachable("write", -1, self.peer, detail="the link is closed")
        key = layout_key(groups, flat)
        table = self._tables.find(key)
        if table is None:
            layout = lay_out(checked())
            if not len(layout.values):
                return CudaPrepared(self, [], (), layout.nbytes)
            copier = self._t.copier
            try:
                with self._t.driver.current(copier.context()):
                    table = copier.prepare(key, layout, self._stream, self._tables)
            except RuntimeError as exc:  # torch's pinned or device allocation (out of memory, ...)
                raise TransportError(f"cuda-ipc: laying out a write failed: {exc}") from exc
        return CudaPrepared(self, table.calls, (table,), table.write_bytes)

    def chain(self, writes: Sequence[PreparedWrite]) -> PreparedWrite:
        """One launch sequence on the stream, in order, and one event (a body and its AUX
        row: one hand-off instead of two, ~0.03 ms less host time per send)."""
        if not all(isinstance(w, CudaPrepared) and w._link is self for w in writes):
            return super().chain(writes)
        if any(w._calls is None for w in writes):
            raise RuntimeError("a prepared write starts once")
        taken = [w._take() for w in writes]
        return CudaPrepared(
            self,
            [c for calls, _ in taken for c in calls],
            [t for _, ts in taken for t in ts],
            sum(w.nbytes for w in writes),
        )

    def fan(self) -> FanWriter:
        """Its transport's fan-outs (cuda_fan.py): this link's write beside other links' of the
        same transport as one launch."""
        return self._t.fan()

    def probe(self) -> None:
        """A mapping says nothing about its owner (writes after it exited still "succeed"):
        ask whether the owning process exists (where PIDs are shared, as they must be here)."""
        try:
            os.kill(self._pid, 0)
        except ProcessLookupError:
            raise PeerUnreachable("probe", -1, self.peer, detail="the process that owns the memory is gone") from None
        except PermissionError:
            pass  # it exists, under another user

    def close(self) -> None:
        """Unmap the peer's memory once every write on our stream is done; later writes are
        refused (PeerUnreachable)."""
        with self._lock:
            self._closed = True
            if getattr(self, "_stream", None) is not None:
                self._stream.synchronize()
            if getattr(self, "_tables", None) is not None:
                self._tables.clear()
            mapped, self._mapped = self._mapped, {}
            if not mapped:
                return
            driver, failed = self._t.driver, []
            with driver.current(self._t.copier.context()):
                for ptr in mapped.values():  # every one, even after a failure
                    try:
                        driver.close(ptr)
                    except TransportError as exc:
                        failed.append(exc)
            if failed:
                raise failed[0]


class CudaIpcTransport(Transport):
    kind = KIND

    def __init__(self, device: int | None = None, blocks: int = 64, threads: int = 512):
        import torch

        if not torch.cuda.is_available():
            raise TransportError("cuda-ipc needs a CUDA device, and torch sees none")
        self.device = torch.cuda.current_device() if device is None else device
        self.host = host_identity()
        self.driver = Driver()
        self.copier = RangeCopier(self.driver, self.device, blocks, threads)
        self._fan: FanWriter | None = None
        self._fan_lock = threading.Lock()
        torch.cuda.init()

    def fan(self) -> FanWriter:
        with self._fan_lock:
            if self._fan is None:
                self._fan = FanWriter(self, COST.link_gbps, CudaWrite)
            return self._fan

    def reach_problem(self, offer: Offer) -> str | None:
        return reach_problem(offer, self.host)

    def expose(self, regions: Sequence[tuple[int, int]]) -> CudaIpcExposure:
        import torch

        torch.cuda.set_device(self.device)
        return CudaIpcExposure(self.driver, regions)

    def connect(self, offer: Offer, local: Exposure, lane: int = 0) -> CudaIpcLink:
        problem = self.reach_problem(offer)
        if problem or not isinstance(local, CudaIpcExposure):
            raise TransportError(problem or f"{KIND} cannot write from a {type(local).__name__}")
        try:
            blob = blob_decoder.decode(offer.blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransportError(f"malformed {KIND} offer: {exc}") from None
        if any(len(r.handle) != 64 or r.offset < 0 or r.nbytes <= 0 for r in blob.regions):
            raise TransportError(f"malformed {KIND} offer: bad region")
        return CudaIpcLink(self, local, blob)


# ---- as the registry sees it (transfer/transports/kind.py) ----


@dataclass(frozen=True)
class CudaIpcSettings:
    blocks: int = 64  # the most thread blocks (SMs' worth) the copy kernel takes (RangeCopier.grid)

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise ValueError(f"cuda-ipc blocks must be at least 1, got {self.blocks}")


def _add_flags(g) -> None:
    g.add_argument(
        "--cuda-ipc-blocks",
        type=positive_int,
        default=CudaIpcSettings.blocks,
        help="the most thread blocks (of 512 threads, one per MiB of a write) the cuda-ipc copy kernel takes: "
        "at most half an H100's SMs by default, so it runs beside compute",
    )


def _settings_from(args: argparse.Namespace) -> CudaIpcSettings:
    return CudaIpcSettings(args.cuda_ipc_blocks)


def _create(common: TransportSettings, own: CudaIpcSettings) -> CudaIpcTransport:
    return CudaIpcTransport(common.cuda_index, blocks=own.blocks)


def _on_cuda(common: TransportSettings) -> bool:
    """Joins `auto` only for pools on CUDA (its peers must be on this host too: offers say)."""
    return common.on_cuda


CUDA_IPC = TransportKind(KIND, _create, CudaIpcSettings, _add_flags, _settings_from, suits=_on_cuda)
