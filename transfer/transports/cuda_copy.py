"""The copy side of the cuda-ipc transport: one kernel on the writer's GPU that copies many
byte ranges (local -> a peer's mapped memory), fed with O(runs + buffers) bytes from the host.

    host: runs + buffer table ---one pinned upload---> GPU: the kernel itself expands row r
          into (buffer r / runs, run r % runs) -> (src, dst, len); nothing else runs on the
          GPU before it (a few long ranges: expanded on the host and cut into 256 KiB pieces,
          only those longer than that); one table for a body and its AUX row, kept per link
          by content (TableCache: the same layout prepared again uploads nothing)
    kernel: each warp copies whole ranges, 16-byte vectors where src, dst and length allow,
            up to four loads in flight per lane (a range's tail too: a 1 KiB fragment's two
            words load together); expanding runs, a warp takes four short ones (16-byte
            aligned, <= 1.5 KiB) at once, all their loads before any store (copy_kernel.cu
            draws it); few blocks (default 32 x 512 threads) so it can run beside compute

    factorized table, int64:  | src_start[n] | dst_start[n] | count[n] | src_base[b] | dst_base[b] | item[b] |
    row r = bi * n + i:        src = src_base[bi] + src_start[i] * item[bi], len = count[i] * item[bi]
    lanes (pools of different page sizes or TP shards, transfer.tokens), int64:
        | src_start[n] | dst_start[n] | count[n] | per lane [b]: src addr, pitch, offset, stride,
          dst addr, pitch, offset, stride, row bytes |
        row r = bi * n + i:    src = addr[bi] + s // rows * pitch[bi] + offset[bi] + s % rows * stride[bi]
                               (a TP slice of each row: the warp copies its rows' 16-byte words,
                               four loads in flight per lane)

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
from pathlib import Path

import numpy as np

from transfer.errors import TransportError
from transfer.transports.cuda_driver import Call, Driver
from transfer.transports.ranges import LaneRuns, RunSet

_PIECE_BYTES = 256 << 10  # longer ranges are split so warps share the work evenly

_KERNEL = (Path(__file__).parent / "copy_kernel.cu").read_text()


_HOST_EXPAND = 1 << 12  # up to this many ranges are expanded on the host (numpy), more on the GPU


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
    """One link's tables by content (every byte of the table: its addresses, runs and sizes),
    the latest `entries` and at most `max_bytes`: a layout prepared again (the same peer, pages
    and sizes) starts from the table already on the device. Tables are made on the link's
    stream, so stream order protects an evicted one as it protects a used one."""

    def __init__(self, driver: Driver, entries: int = 32, max_bytes: int = 16 << 20):
        self.driver, self.entries, self.max_bytes = driver, entries, max_bytes
        self._tables: dict[bytes, Table] = {}  # insertion order: the oldest first
        self._bytes = 0
        self._lock = threading.RLock()  # the cache's and its tables' holders (sends on several threads)

    def get(self, values: np.ndarray, stream) -> Table:
        """The table holding `values` (int64), held once for the caller (Table.drop)."""
        key = values.tobytes()
        with self._lock:
            table = self._tables.pop(key, None)
            if table is None:
                table = Table(values, self.driver, stream, self._lock)
                self._bytes += table.nbytes
            self._tables[key] = table  # the newest now
            table.hold()
            while len(self._tables) > self.entries or (self._bytes > self.max_bytes and len(self._tables) > 1):
                self._evict(next(iter(self._tables)))
            return table

    def _evict(self, key: bytes) -> None:
        table = self._tables.pop(key)
        self._bytes -= table.nbytes
        table.evict()

    def clear(self) -> None:
        """Out of the cache, each back once no prepared write holds it (a closed link's)."""
        with self._lock:
            for key in list(self._tables):
                self._evict(key)


def _flat(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    item = rs.item_bytes[:, None]
    src = (src_base[:, None] + rs.src_start[None, :] * item).ravel()
    dst = (dst_base[:, None] + rs.dst_start[None, :] * item).ravel()
    return src, dst, np.broadcast_to(rs.count[None, :] * item, (len(rs.item_bytes), len(rs.count))).ravel()


def _split(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> np.ndarray:
    """Flat [3, n] (src, dst, len) of a run set on the host, ranges cut into pieces of at most
    _PIECE_BYTES so the warps share long ones."""
    src, dst, length = _flat(rs, src_base, dst_base)
    if not len(length) or int(length.max()) <= _PIECE_BYTES:  # nothing to cut (an AUX row, fragments)
        return np.concatenate([src, dst, length])
    pieces = np.maximum(1, -(-length // _PIECE_BYTES))
    which = np.repeat(np.arange(len(length)), pieces)
    off = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * _PIECE_BYTES
    return np.concatenate([src[which] + off, dst[which] + off, np.minimum(length[which] - off, _PIECE_BYTES)])


def _layout(work) -> tuple[np.ndarray, list[tuple], int]:
    """One group's table values (int64), its launches as (kernel, rows, pointer arguments in
    words from the values' start, other arguments), and its bytes. A fragmented set (many
    short ranges) crosses as runs + buffers and the kernel expands it; a set of few ranges is
    expanded here and split so the warps share long ones: one launch per fragmented set and
    one for all expanded ranges."""
    total, tables, lanes, flats = 0, [], [], []  # factorized (values, n, b); host-expanded [3, k] pieces
    for rs, src_base, dst_base in work:
        if not len(rs):
            continue
        total += rs.nbytes
        if isinstance(rs, LaneRuns):  # src_base / dst_base: each lane's buffer address
            lanes.append(
                (
                    np.concatenate(
                        [
                            rs.src_start,
                            rs.dst_start,
                            rs.count,
                            src_base,
                            rs.src_pitch,
                            rs.src_offset,
                            rs.src_stride,
                            dst_base,
                            rs.dst_pitch,
                            rs.dst_offset,
                            rs.dst_stride,
                            rs.row_bytes,
                        ]
                    ),
                    len(rs.count),
                    len(rs.row_bytes),
                    rs.src_rows,
                    rs.dst_rows,
                )
            )
            continue
        longest = int(rs.count.max()) * int(rs.item_bytes.max())
        if longest <= _PIECE_BYTES and len(rs) > _HOST_EXPAND:
            tables.append(
                (
                    np.concatenate([rs.src_start, rs.dst_start, rs.count, src_base, dst_base, rs.item_bytes]),
                    len(rs.count),
                    len(rs.item_bytes),
                )
            )
        else:
            flats.append(_split(rs, src_base, dst_base).reshape(3, -1))
    flat = np.concatenate(flats, axis=1).ravel() if flats else np.empty(0, np.int64)
    specs, at = [], len(flat)
    if len(flat):
        k = len(flat) // 3
        specs.append(("copy_ranges", k, (0, k, 2 * k), (k,)))
    for name, sets in (("copy_runs", tables), ("copy_lanes", lanes)):
        for values, n, b, *rows in sets:
            specs.append((name, n * b, (at,), (n, b, *rows)))
            at += len(values)
    return np.concatenate([flat, *(t[0] for t in tables + lanes)]).astype(np.int64, copy=False), specs, total


class RangeCopier:
    """The kernel and its launches for one device, through the driver (cuda_driver.py)."""

    def __init__(self, driver: Driver, device: int, blocks: int = 32, threads: int = 512):
        self.driver, self.device, self.blocks, self.threads = driver, device, blocks, threads
        self._module, self._functions, self._ctx = None, {}, None
        self._init = threading.Lock()  # links share the copier: one compile, one context retain

    def prepare(self, groups, stream, cache: TableCache) -> tuple[list[Call], Table | None, int]:
        """Lay out copies for `stream` (the link's torch.cuda.Stream; context() current): one
        table for all of them (from `cache`: uploaded unless the same layout was before), their
        launches packed, each group's after the previous group's (a body, then its AUX row);
        returns (launches, the table, held for the caller, bytes). A group is a list of work:
        (RunSet in items, src address per buffer, dst address per buffer), or (LaneRuns, src
        address per lane, dst address per lane), all on the host."""
        parts, launches, total, at = [], [], 0, 0
        for work in groups:
            values, specs, nbytes = _layout(work)
            launches += [(name, rows, tuple(at + p for p in ptrs), ints) for name, rows, ptrs, ints in specs]
            parts.append(values)
            at, total = at + len(values), total + nbytes
        if not at:
            return [], None, total
        table = cache.get(np.concatenate(parts).astype(np.int64, copy=False), stream)
        try:
            calls = [
                self._call(name, rows, *(table.ptr + 8 * p for p in ptrs), *ints) for name, rows, ptrs, ints in launches
            ]
        except BaseException:
            table.drop()
            raise
        return [c for c in calls if c is not None], table, total

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

    def _call(self, name: str, rows: int, *args: int) -> Call | None:
        if rows == 0:
            return None
        return self.driver.call(
            self._function(name),
            min(self.blocks, -(-rows * 32 // self.threads)),
            self.threads,
            tuple(int(a) for a in args),
        )
