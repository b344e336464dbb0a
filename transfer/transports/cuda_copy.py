"""The copy side of the cuda-ipc transport: one kernel on the writer's GPU that copies many
byte ranges (local -> a peer's mapped memory), fed with O(runs + buffers) bytes from the host.

    host: runs + buffer table ---one pinned upload---> GPU: expand to (src, dst, len) rows
          (a few long ranges: expanded and split on the host; >= 4 MiB ones go to the copy
          engine as cudaMemcpyAsync)
    kernel: each warp copies whole ranges, 16-byte vectors where src, dst and length allow,
            four loads in flight per lane; few blocks (default 32 x 512 threads) so it can
            run beside compute

Why a CuPy RawKernel (CUDA C, compiled once by NVRTC): a copy of millions of 2 KiB fragments
needs warp-per-range scheduling and 16-byte vector moves; torch's index_copy_ reached 0.77 of
the p2p limit and copy-engine batches 0.35 (../shared/gpu-notes.md), a custom kernel 0.9.
"""

import numpy as np

from transfer.transports.base import RunSet

_MEMCPY_BYTES = 4 << 20       # a range this long goes to the copy engine (cudaMemcpyAsync)
_PIECE_BYTES = 256 << 10      # longer ranges are split so warps share the work evenly

_KERNEL = r"""
extern "C" __global__ void copy_ranges(const long long* __restrict__ src, const long long* __restrict__ dst,
                                       const long long* __restrict__ len, long long n) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const char* s = (const char*)src[r];
        char* d = (char*)dst[r];
        const long long m = len[r];
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
}
"""


_HOST_EXPAND = 1 << 12         # up to this many ranges are expanded on the host (numpy), more on the GPU
_FEW = 8                       # a write of this many ranges or fewer (the AUX row) is plain memcpys
_streams: dict[int, object] = {}


def _cupy_stream(stream, device: int):
    """CuPy's view of a torch stream (made once per stream)."""
    import cupy
    key = stream.cuda_stream
    if key not in _streams:
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        try:
            _streams[key] = from_external(stream) if from_external else cupy.cuda.ExternalStream(key, device)
        except (TypeError, AttributeError):   # torch's stream without the CUDA stream protocol
            _streams[key] = cupy.cuda.ExternalStream(key, device)
    return _streams[key]


class Uploads:
    """One pinned host buffer per link, reused for every upload (allocating pinned memory per
    write cost about half a millisecond each); an event says when the last copy left it."""

    def __init__(self) -> None:
        self._host = None
        self._done = None

    def put(self, values: np.ndarray, device, stream):
        import torch
        if self._done is not None:
            self._done.synchronize()   # the previous upload has left the buffer (long since, as a rule)
        if self._host is None or self._host.numel() < len(values):
            self._host = torch.empty(max(len(values), 2 * (0 if self._host is None else self._host.numel()), 4096),
                                     dtype=torch.int64, pin_memory=True)
        host = self._host[:len(values)]
        host.numpy()[:] = values
        out = host.to(device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(stream)
        return out


def _flat(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    item = rs.item_bytes[:, None]
    src = (src_base[:, None] + rs.src_start[None, :] * item).ravel()
    dst = (dst_base[:, None] + rs.dst_start[None, :] * item).ravel()
    return src, dst, np.broadcast_to(rs.count[None, :] * item, (len(rs.item_bytes), len(rs.count))).ravel()


def _memcpys(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray, stream) -> None:
    import cupy
    for s, d, n in zip(*(a.tolist() for a in _flat(rs, src_base, dst_base))):
        cupy.cuda.runtime.memcpyAsync(d, s, n, 4, stream.cuda_stream)   # 4: cudaMemcpyDefault (UVA)


def _split(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray, stream) -> np.ndarray:
    """Flat [3, n] (src, dst, len) of a run set on the host: ranges of _MEMCPY_BYTES or more are
    handed to the copy engine now, the others are cut into pieces of at most _PIECE_BYTES."""
    import cupy
    src, dst, length = _flat(rs, src_base, dst_base)
    big = length >= _MEMCPY_BYTES
    for s, d, n in zip(src[big].tolist(), dst[big].tolist(), length[big].tolist()):
        cupy.cuda.runtime.memcpyAsync(d, s, n, 4, stream.cuda_stream)   # 4: cudaMemcpyDefault (UVA)
    src, dst, length = src[~big], dst[~big], length[~big]
    pieces = np.maximum(1, -(-length // _PIECE_BYTES))
    which = np.repeat(np.arange(len(length)), pieces)
    off = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * _PIECE_BYTES
    return np.concatenate([src[which] + off, dst[which] + off, np.minimum(length[which] - off, _PIECE_BYTES)])


class RangeCopier:
    """The kernel and its launches for one device."""

    def __init__(self, device: int, blocks: int = 32, threads: int = 512):
        self.device, self.blocks, self.threads = device, blocks, threads
        self._kernel = None

    def submit(self, work, stream, uploads: "Uploads") -> int:
        """Queue copies on `stream`; returns the bytes. work: (RunSet in items, src address
        per buffer, dst address per buffer), all on the host.
        A fragmented set (many short ranges) crosses as runs + buffers and is expanded on the
        GPU; a set with long ranges (few of them) is expanded here, long ranges go to the copy
        engine and the rest are split so the warps share them evenly. One upload and one
        kernel per write; no call waits on the GPU."""
        import torch
        dev = torch.device("cuda", self.device)
        total, parts = 0, []   # (host int64 values, how to read them on the GPU)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for rs, src_base, dst_base in work:
                total += rs.nbytes
                longest = int(rs.count.max()) * int(rs.item_bytes.max())
                if len(rs) <= _FEW:   # no upload, no kernel: a few copy-engine calls
                    _memcpys(rs, src_base, dst_base, stream)
                elif longest <= _PIECE_BYTES and len(rs) > _HOST_EXPAND:
                    parts.append((np.concatenate([rs.src_start, rs.dst_start, rs.count, src_base, dst_base,
                                                  rs.item_bytes]), (len(rs.count), len(rs.item_bytes))))
                else:
                    parts.append((_split(rs, src_base, dst_base, stream), None))
            if parts:
                g = uploads.put(np.concatenate([v for v, _ in parts]) if len(parts) > 1 else parts[0][0], dev, stream)
                flats, at = [], 0
                for values, shape in parts:
                    seg, at = g[at:at + len(values)], at + len(values)
                    if shape is None:
                        flats.append(seg.view(3, -1))
                        continue
                    n, b = shape
                    s0, d0, cnt = seg[:n], seg[n:2 * n], seg[2 * n:3 * n]
                    sb, db, it = seg[3 * n:3 * n + b], seg[3 * n + b:3 * n + 2 * b], seg[3 * n + 2 * b:]
                    flats.append(torch.stack([(sb[:, None] + s0[None, :] * it[:, None]).reshape(-1),
                                              (db[:, None] + d0[None, :] * it[:, None]).reshape(-1),
                                              (cnt[None, :] * it[:, None]).reshape(-1)]))
                self.launch(flats[0] if len(flats) == 1 else torch.cat(flats, dim=1), stream)
        return total

    def launch(self, flat, stream) -> None:
        """The copy kernel over flat [3, n] int64 (src, dst, len) device rows, on `stream`."""
        import cupy
        n = flat.shape[1]
        if n == 0:
            return
        if self._kernel is None:
            self._kernel = cupy.RawKernel(_KERNEL, "copy_ranges")
        flat = flat.contiguous()
        row = flat.stride(0) * flat.element_size()
        base = flat.data_ptr()
        with _cupy_stream(stream, self.device):
            self._kernel((min(self.blocks, -(-n * 32 // self.threads)),), (self.threads,),
                         (np.uint64(base), np.uint64(base + row), np.uint64(base + 2 * row), np.int64(n)))
