"""The copy side of the cuda-ipc transport: one kernel on the writer's GPU that copies many
byte ranges (local -> a peer's mapped memory), fed with O(runs + buffers) bytes from the host.

    host: runs + buffer table ---one pinned upload---> GPU: the kernel itself expands row r
          into (buffer r / runs, run r % runs) -> (src, dst, len); nothing else runs on the
          GPU before it (a few long ranges: expanded on the host and cut into 256 KiB pieces,
          only those longer than that: cuda_layout.py, the host side); one table for a body
          and its AUX row, kept per link by the runsets it was laid out from (TableCache: the
          same pages to the same peer again lay out, check and upload nothing)
    kernel: each warp copies whole ranges, 16-byte vectors where src, dst and length allow,
            up to four loads in flight per lane (a range's tail too: a 1 KiB fragment's two
            words load together); expanding runs, a warp takes four short ones (16-byte
            aligned, <= 1.5 KiB) at once, all their loads before any store (copy_kernel.cu
            draws it); blocks of 512 threads, a block per MiB of the write, 32 to 64 (the
            cap, --cuda-ipc-blocks: at most half an H100's SMs, so it runs beside compute)

    factorized table, int64:  | src_start[n] | dst_start[n] | count[n] | src_base[b] | dst_base[b] | item[b] |
    row r = bi * n + i:        src = src_base[bi] + src_start[i] * item[bi], len = count[i] * item[bi]
    lanes (pools of different page sizes or TP shards, transfer.tokens), int64:
        | src_start[n] | dst_start[n] | count[n] | per lane [b]: src addr, pitch, offset, stride,
          dst addr, pitch, offset, stride, row bytes |
        row r = bi * n + i:    src = addr[bi] + s // rows * pitch[bi] + offset[bi] + s % rows * stride[bi]
                               (a TP slice of each row: a warp takes two (run, lane) rows at
                               once and, where each is at most 2 KiB, loads all their 16-byte
                               words before any store; larger ones one by one)

Why a CuPy RawKernel (CUDA C, compiled once by NVRTC): a copy of millions of 2 KiB fragments
needs warp-per-range scheduling and 16-byte vector moves; torch's index_copy_ reached 0.77 of
the p2p limit and copy-engine batches 0.35 (docs/contract.md, "Figures behind the defaults"),
a custom kernel 0.9. CuPy compiles it; launches, uploads and events go straight to the driver
(cuda_driver.py says why).
Why no cudaMemcpyAsync, not even for the AUX row or multi-MiB runs: into a peer's IPC mapping
each call cost the host about a millisecond (cProfile on an H100: 1.8 ms per call), and the
rows measured 10-20% faster end to end with the kernel doing everything
(docs/bench_transfer_gpu.json, "kernel_only").
"""

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transfer.errors import TransportError
from transfer.transports.cuda_driver import Call, Driver
from transfer.transports.cuda_layout import Layout, LayoutKey

_KERNEL = (Path(__file__).parent / "copy_kernel.cu").read_text()
BLOCK_BYTES = 1 << 20  # a write gets a thread block per MiB it moves (RangeCopier.grid) ...
MIN_BLOCKS = 32  # ... and at least this many (where it has the rows: an AUX row takes one)


class Table:
    """A kernel table on the device: a block of torch's caching allocator taken on the link's
    stream, filled from pinned host memory. Stream order keeps the block safe to hand back as
    soon as the kernels that read it are queued (the allocator gives it only to later work on
    that stream); the pinned source stays with each write that read it until that write is
    done (its upload, queued earlier on the stream, is done by then).

    Tables are shared (TableCache: the same layout prepared again, e.g. a request on the
    same pages, reuses its table: no pinned copy, no allocation, no upload): each prepared
    write holds it (hold) until its launches are queued or it is dropped (drop); the block
    goes back once it is out of the cache and no prepared write holds it."""

    def __init__(self, values: np.ndarray, driver: Driver, stream, lock: threading.RLock) -> None:
        import torch

        self.nbytes, self.users, self.cached, self._lock = values.nbytes, 0, True, lock  # lock: its cache's
        self.calls: list[Call] = []  # the launches that read it (packed once: RangeCopier.prepare)
        self.write_bytes = 0  # bytes those launches copy
        self.host = torch.from_numpy(values).pin_memory()  # torch's pinned cache: no cudaHostAlloc per write
        self.ptr = torch.cuda.caching_allocator_alloc(values.nbytes, stream.device, stream)
        try:
            driver.upload(self.ptr, self.host.data_ptr(), values.nbytes, stream.cuda_stream)
        except BaseException:
            self.release()
            raise

    def hold(self) -> None:
        with self._lock:
            self.users += 1

    def drop(self) -> None:
        """A holder's launches are queued (or it will never start): its block may go back."""
        with self._lock:
            self.users -= 1
            if self.users <= 0 and not self.cached:
                self.release()

    def evict(self) -> None:
        with self._lock:
            self.cached = False
            if self.users <= 0:
                self.release()

    def release(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            import torch

            torch.cuda.caching_allocator_delete(ptr)

    def __del__(self) -> None:  # dropped by every holder and the cache
        try:
            self.release()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class TableCache:
    """One link's tables by the runsets they were laid out from (cuda_layout.layout_key: their
    runs, buffers and lanes; the link's regions are fixed), the latest `entries` and at most
    `max_bytes`: a layout prepared again (the same peer and pages) starts from the table
    already on the device, its launches packed, nothing laid out or checked again. Tables are
    made on the link's stream, so stream order protects an evicted one as it protects a used
    one."""

    def __init__(self, driver: Driver, entries: int = 32, max_bytes: int = 16 << 20):
        self.driver, self.entries, self.max_bytes = driver, entries, max_bytes
        self._tables: dict[object, tuple[LayoutKey, Table]] = {}  # insertion order: the oldest first
        self._bytes = 0
        self._lock = threading.RLock()  # the cache's and its tables' holders (sends on several threads)

    def find(self, key: LayoutKey) -> Table | None:
        """The table laid out for `key`, held once for the caller (Table.drop), or None."""
        with self._lock:
            hit = self._tables.get(key.digest)
            if hit is None or not hit[0].matches(key):
                return None
            self._tables[key.digest] = self._tables.pop(key.digest)  # the newest now
            hit[1].hold()
            return hit[1]

    def add(self, key: LayoutKey, layout: Layout, stream, pack: Callable[[Table], list[Call]]) -> Table:
        """A new table of `layout` for `key`, its launches packed by `pack` before any other
        thread can find it, held once for the caller."""
        table = Table(layout.values, self.driver, stream, self._lock)
        try:
            table.calls, table.write_bytes = pack(table), layout.nbytes
        except BaseException:
            table.release()
            raise
        with self._lock:
            if key.digest in self._tables:  # (another thread laid the same out meanwhile)
                self._evict(key.digest)
            self._tables[key.digest] = (key, table)
            self._bytes += table.nbytes + (key.values.nbytes if key.values is not None else 0)
            table.hold()
            while len(self._tables) > self.entries or (self._bytes > self.max_bytes and len(self._tables) > 1):
                self._evict(next(iter(self._tables)))
            return table

    def _evict(self, digest: object) -> None:
        key, table = self._tables.pop(digest)
        self._bytes -= table.nbytes + (key.values.nbytes if key.values is not None else 0)
        table.evict()

    def clear(self) -> None:
        """Out of the cache, each back once no prepared write holds it (a closed link's)."""
        with self._lock:
            for digest in list(self._tables):
                self._evict(digest)


class RangeCopier:
    """The kernel and its launches for one device, through the driver (cuda_driver.py)."""

    def __init__(self, driver: Driver, device: int, blocks: int = 64, threads: int = 512):
        self.driver, self.device, self.blocks, self.threads = driver, device, blocks, threads
        self._module, self._functions, self._ctx = None, {}, None
        self._init = threading.Lock()  # links share the copier: one compile, one context retain

    def prepare(self, key: LayoutKey, layout: Layout, stream, cache: TableCache) -> Table:
        """`layout`'s table on the device for `stream` (the link's torch.cuda.Stream; context()
        current), cached under `key` with its launches packed (Table.calls); held for the caller."""

        def pack(table: Table) -> list[Call]:
            calls = [
                self._call(name, rows, layout.nbytes, *(table.ptr + 8 * p for p in ptrs), *ints)
                for name, rows, ptrs, ints in layout.launches
            ]
            return [c for c in calls if c is not None]

        return cache.add(key, layout, stream, pack)

    def context(self) -> int:
        """The device's primary context: current on the calling thread around prepare()
        and a prepared write's launches."""
        if self._ctx is None:
            with self._init:
                if self._ctx is None:
                    self._ctx = self.driver.primary_context(self.device)
        return self._ctx

    def _function(self, name: str) -> int:
        """The kernel's CUfunction, compiled once by CuPy (NVRTC, cached on disk) and loaded
        into this device's primary context."""
        if name in self._functions:
            return self._functions[name]
        with self._init:
            if name in self._functions:
                return self._functions[name]
            import cupy

            if self._module is None:
                self._module = cupy.RawModule(code=_KERNEL)
            with cupy.cuda.Device(self.device):
                ptr = getattr(getattr(self._module.get_function(name), "kernel", None), "ptr", None)
            if not ptr:
                raise TransportError(
                    f"cuda-ipc: CuPy {cupy.__version__} gives no function handle for its kernel (RawKernel.kernel.ptr)"
                )
            self._functions[name] = int(ptr)
        return self._functions[name]

    def grid(self, rows: int, nbytes: int) -> int:
        """Thread blocks for a launch of `rows` warp items in a write of `nbytes`: a block per
        BLOCK_BYTES, at least MIN_BLOCKS, at most `blocks` (the cap) and the warps the rows
        can use. Why scaled: the copy is bound by memory latency, so its speed is the warps in
        flight; a big write on 32 blocks ran at 600 GB/s, on 64 at 920, on 132 (every SM of an
        H100) at 970 (scripts/device/bench_lanes.py, a gpt-oss-120b 8:1 sender's table at 32k).
        Why capped: the kernel shares the GPU with the model's (a streamed send runs beside
        the compute, and eight sender processes time-slice one GPU), so it takes at most
        `blocks` SMs, half an H100's by default: 95% of the whole GPU's speed for the copy."""
        want = max(MIN_BLOCKS, -(-nbytes // BLOCK_BYTES))
        return max(1, min(self.blocks, want, -(-rows * 32 // self.threads)))

    def _call(self, name: str, rows: int, nbytes: int, *args: int) -> Call | None:
        if rows == 0:
            return None
        return self.driver.call(
            self._function(name), self.grid(rows, nbytes), self.threads, tuple(int(a) for a in args)
        )
