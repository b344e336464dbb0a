"""The copy side of the cuda-ipc transport: one kernel on the writer's GPU that copies many
byte ranges (local -> a peer's mapped memory), fed with O(runs + buffers) bytes from the host.

    host: runs + buffer table ---one pinned upload---> GPU: the kernel itself expands row r
          into (buffer r / runs, run r % runs) -> (src, dst, len); nothing else runs on the
          GPU before it (a few long ranges: expanded on the host and cut into 256 KiB pieces)
    kernel: each warp copies whole ranges, 16-byte vectors where src, dst and length allow,
            four loads in flight per lane; few blocks (default 32 x 512 threads) so it can
            run beside compute

    factorized table, int64:  | src_start[n] | dst_start[n] | count[n] | src_base[b] | dst_base[b] | item[b] |
    row r = bi * n + i:        src = src_base[bi] + src_start[i] * item[bi], len = count[i] * item[bi]
    lanes (pools of different page sizes or TP shards, transfer.tokens), int64:
        | src_start[n] | dst_start[n] | count[n] | per lane [b]: src addr, pitch, offset, stride,
          dst addr, pitch, offset, stride, row bytes |
        row r = bi * n + i:    src = addr[bi] + s // rows * pitch[bi] + offset[bi] + s % rows * stride[bi]
                               (a TP slice of each row: the warp copies its rows' 16-byte words)

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

import numpy as np

from transfer.errors import TransportError
from transfer.transports.cuda_driver import Driver
from transfer.transports.ranges import LaneRuns, RunSet

_PIECE_BYTES = 256 << 10      # longer ranges are split so warps share the work evenly

_KERNEL = r"""
__device__ __forceinline__ void copy_one(const char* s, char* d, long long m, long long lane) {
    if ((((unsigned long long)s | (unsigned long long)d | (unsigned long long)m) & 15) == 0) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        const long long m4 = m >> 4;
        long long i = lane;
        for (; i + 96 < m4; i += 128) {           // four 16-byte loads in flight per lane
            uint4 a = s4[i], b = s4[i + 32], c = s4[i + 64], e = s4[i + 96];
            d4[i] = a; d4[i + 32] = b; d4[i + 64] = c; d4[i + 96] = e;
        }
        for (; i < m4; i += 32) d4[i] = s4[i];
    } else {
        for (long long i = lane; i < m; i += 32) d[i] = s[i];
    }
}

extern "C" __global__ void copy_ranges(const long long* __restrict__ src, const long long* __restrict__ dst,
                                       const long long* __restrict__ len, long long n) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps)
        copy_one((const char*)src[r], (char*)dst[r], len[r], lane);
}

extern "C" __global__ void copy_runs(const long long* __restrict__ t, long long n, long long b) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* sb = t + 3 * n;
    const long long* db = sb + b;
    const long long* it = db + b;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n * b; r += warps) {
        const long long bi = r / n, i = r - bi * n, item = it[bi];
        copy_one((const char*)(sb[bi] + t[i] * item), (char*)(db[bi] + t[n + i] * item), t[2 * n + i] * item, lane);
    }
}

__device__ __forceinline__ void copy_rows(const char* s, char* d, long long ss, long long ds, long long row,
                                          long long k, long long lane) {
    // k rows of `row` bytes, `ss` / `ds` apart: the warp's lanes take 16-byte words of all rows
    if ((((unsigned long long)s | (unsigned long long)d | ss | ds | row) & 15) == 0) {
        const long long w = row >> 4, total = k * w;
        for (long long x = lane; x < total; x += 32) {
            const long long j = x / w, q = x - j * w;
            ((uint4*)(d + j * ds))[q] = ((const uint4*)(s + j * ss))[q];
        }
    } else {
        const long long total = k * row;
        for (long long x = lane; x < total; x += 32) {
            const long long j = x / row, q = x - j * row;
            d[j * ds + q] = s[j * ss + q];
        }
    }
}

extern "C" __global__ void copy_lanes(const long long* __restrict__ t, long long n, long long b,
                                      long long srows, long long drows) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* L = t + 3 * n;   // per lane: address, pitch, offset, stride (src, dst), row bytes
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n * b; r += warps) {
        const long long bi = r / n, i = r - bi * n, s = t[i], d = t[n + i], k = t[2 * n + i];
        const long long ss = L[3 * b + bi], ds = L[7 * b + bi], row = L[8 * b + bi];
        const char* src = (const char*)(L[bi] + s / srows * L[b + bi] + L[2 * b + bi] + s % srows * ss);
        char* dst = (char*)(L[4 * b + bi] + d / drows * L[5 * b + bi] + L[6 * b + bi] + d % drows * ds);
        if (ss == row && ds == row) copy_one(src, dst, k * row, lane);
        else copy_rows(src, dst, ss, ds, row, k, lane);
    }
}
"""


_HOST_EXPAND = 1 << 12         # up to this many ranges are expanded on the host (numpy), more on the GPU


class Uploads:
    """One pinned host buffer and one device buffer per link, reused for every upload
    (allocating pinned memory per write cost about half a millisecond); an event says when the
    last copy has left the host buffer. The device buffer is allocated on the link's stream
    (torch's allocator then hands it no block another stream may still use) and stream order
    keeps it safe: the next upload into it starts after the kernels that read the last one.
    So put() waits at most for the write before last to finish: the GPU always has the next
    write queued behind the one it runs."""

    def __init__(self, driver: Driver, stream) -> None:
        self._d, self._stream = driver, stream   # stream: the link's torch.cuda.Stream
        self._host = self._dev = None
        self._uploaded = None

    def put(self, values: np.ndarray) -> int:
        """Queue values (int64) onto the device on the link's stream; returns their address."""
        import torch
        handle = self._stream.cuda_stream
        if self._uploaded is None:
            self._uploaded = self._d.event()
        else:
            self._uploaded.synchronize()   # the previous upload has left the host buffer
        if self._host is None or self._host.numel() < len(values):
            n = max(len(values), 2 * (0 if self._host is None else self._host.numel()), 4096)
            if self._dev is not None:
                self._d.synchronize_stream(handle)   # no kernel still reads the old device buffer
            self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(self._stream):
                self._dev = torch.empty(n, dtype=torch.int64, device=self._stream.device)
        self._host.numpy()[:len(values)] = values
        self._d.upload(self._dev.data_ptr(), self._host.data_ptr(), values.nbytes, handle)
        self._uploaded.record(handle)
        return self._dev.data_ptr()


def _flat(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    item = rs.item_bytes[:, None]
    src = (src_base[:, None] + rs.src_start[None, :] * item).ravel()
    dst = (dst_base[:, None] + rs.dst_start[None, :] * item).ravel()
    return src, dst, np.broadcast_to(rs.count[None, :] * item, (len(rs.item_bytes), len(rs.count))).ravel()


def _split(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> np.ndarray:
    """Flat [3, n] (src, dst, len) of a run set on the host, ranges cut into pieces of at most
    _PIECE_BYTES so the warps share long ones."""
    src, dst, length = _flat(rs, src_base, dst_base)
    pieces = np.maximum(1, -(-length // _PIECE_BYTES))
    which = np.repeat(np.arange(len(length)), pieces)
    off = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * _PIECE_BYTES
    return np.concatenate([src[which] + off, dst[which] + off, np.minimum(length[which] - off, _PIECE_BYTES)])


class RangeCopier:
    """The kernel and its launches for one device, through the driver (cuda_driver.py)."""

    def __init__(self, driver: Driver, device: int, blocks: int = 32, threads: int = 512):
        self.driver, self.device, self.blocks, self.threads = driver, device, blocks, threads
        self._module, self._functions, self._ctx = None, {}, None
        self._init = threading.Lock()   # links share the copier: one compile, one context retain

    def submit(self, work, stream: int, uploads: Uploads) -> int:
        """Queue copies on `stream` (a CUDA stream handle; context() current); returns the
        bytes. work: (RunSet
        in items, src address per buffer, dst address per buffer), or (LaneRuns, src address
        per lane, dst address per lane), all on the host.
        A fragmented set (many short ranges) crosses as runs + buffers and the kernel expands
        it; a set of few ranges is expanded here and split so the warps share long ones. One
        upload, then only kernel launches (one per fragmented set, one for all expanded
        ranges); nothing waits on the GPU but the upload's turn (Uploads)."""
        total, tables, lanes, flats = 0, [], [], []   # factorized (values, n, b); host-expanded [3, k] pieces
        for rs, src_base, dst_base in work:
            if not len(rs):
                continue
            total += rs.nbytes
            if isinstance(rs, LaneRuns):   # src_base / dst_base: each lane's buffer address
                lanes.append((np.concatenate([rs.src_start, rs.dst_start, rs.count, src_base, rs.src_pitch,
                                              rs.src_offset, rs.src_stride, dst_base, rs.dst_pitch, rs.dst_offset,
                                              rs.dst_stride, rs.row_bytes]),
                              len(rs.count), len(rs.row_bytes), rs.src_rows, rs.dst_rows))
                continue
            longest = int(rs.count.max()) * int(rs.item_bytes.max())
            if longest <= _PIECE_BYTES and len(rs) > _HOST_EXPAND:
                tables.append((np.concatenate([rs.src_start, rs.dst_start, rs.count, src_base, dst_base,
                                               rs.item_bytes]), len(rs.count), len(rs.item_bytes)))
            else:
                flats.append(_split(rs, src_base, dst_base).reshape(3, -1))
        flat = np.concatenate(flats, axis=1).ravel() if flats else np.empty(0, np.int64)
        if not tables and not lanes and not len(flat):
            return total
        base = uploads.put(np.concatenate([flat, *(t[0] for t in tables + lanes)]).astype(np.int64, copy=False))
        word = 8
        if len(flat):
            k = len(flat) // 3
            self._launch("copy_ranges", k, stream, base, base + k * word, base + 2 * k * word, k)
        at = len(flat)
        for name, sets in (("copy_runs", tables), ("copy_lanes", lanes)):
            for values, n, b, *rows in sets:
                self._launch(name, n * b, stream, base + at * word, n, b, *rows)
                at += len(values)
        return total

    def context(self) -> int:
        """The device's primary context: current on the calling thread around submit()."""
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
                raise TransportError(f"cuda-ipc: CuPy {cupy.__version__} gives no function handle for its kernel "
                                     "(RawKernel.kernel.ptr)")
            self._functions[name] = int(ptr)
        return self._functions[name]

    def _launch(self, name: str, rows: int, stream: int, *args: int) -> None:
        if rows == 0:
            return
        self.driver.launch(self._function(name), min(self.blocks, -(-rows * 32 // self.threads)), self.threads,
                           stream, tuple(int(a) for a in args))
