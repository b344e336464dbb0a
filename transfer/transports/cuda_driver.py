"""The CUDA driver calls of the cuda-ipc transport, through ctypes (libcuda ships with the
driver): IPC handles, and the hot path of a write.

    one write, all on the link's stream (a few microseconds of host time per call):
      prepare (may run while the KV is still computed):
        cuCtxSetCurrent -> cuMemcpyHtoDAsync(table, pinned -> device); kernel parameters packed
      start (once the KV is final):
        cuCtxSetCurrent -> cuLaunchKernel x k -> cuEventRecord(done)

Why not CuPy's kernel call and torch's copy and events: on an H100 the host spent ~0.29 ms
in a CuPy RawKernel call and ~0.25 ms more in torch's device/stream contexts, H2D copy and
event per write (cProfile, docs/bench_transfer_gpu.json "host_path"), where a 2k-token write
moves its bytes in ~0.2 ms. CuPy still compiles the kernel (NVRTC, cached); only its
function handle is used here. Preparing a write (off the path once the KV is final) still
uses torch: its pinned-memory cache for the table's host copy, its caching allocator for the
device block.
"""

import ctypes
from contextlib import contextmanager

from transfer.errors import TransportError

_vp, _u32, _u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64
NOT_READY = 600  # CUDA_ERROR_NOT_READY
BLOCKING_SYNC, DISABLE_TIMING = 1, 2


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: that reads back cut at the first NUL


class Driver:
    MEMORYTYPE_ATTRIBUTE, DEVICE = 2, 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_DEVICE
    LAZY_ENABLE_PEER_ACCESS = 1

    def __init__(self) -> None:
        try:
            self.lib = lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransportError(f"cuda-ipc needs the CUDA driver (libcuda.so.1): {exc}") from None
        self._check("cuInit", lib.cuInit(0))
        # the hot path's calls with their C signatures (faster calls, and no silent int truncation)
        self._set_ctx = self._fn("cuCtxSetCurrent", _vp)
        self._get_ctx = self._fn("cuCtxGetCurrent", ctypes.POINTER(_vp))
        self._launch = self._fn(
            "cuLaunchKernel", _vp, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _vp, ctypes.POINTER(_vp), _vp
        )
        self._htod = self._fn("cuMemcpyHtoDAsync_v2", _u64, _vp, ctypes.c_size_t, _vp)
        self._stream_sync = self._fn("cuStreamSynchronize", _vp)
        self._ev_create = self._fn("cuEventCreate", ctypes.POINTER(_vp), _u32)
        self._ev_record = self._fn("cuEventRecord", _vp, _vp)
        self._ev_query = self._fn("cuEventQuery", _vp)
        self._ev_sync = self._fn("cuEventSynchronize", _vp)
        self._ev_destroy = self._fn("cuEventDestroy_v2", _vp)
        self._stream_wait = self._fn("cuStreamWaitEvent", _vp, _vp, _u32)

    def _fn(self, name: str, *argtypes):
        f = getattr(self.lib, name)
        f.argtypes, f.restype = list(argtypes), ctypes.c_int
        return f

    def _check(self, what: str, code: int) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise TransportError(f"cuda-ipc: {what} failed: {(name.value or b'?').decode()} ({code})")

    # ---- memory and IPC ------------------------------------------------------------------
    def is_device_memory(self, ptr: int) -> bool:
        kind = ctypes.c_uint(0)
        code = self.lib.cuPointerGetAttribute(ctypes.byref(kind), self.MEMORYTYPE_ATTRIBUTE, ctypes.c_uint64(ptr))
        return code == 0 and kind.value == self.DEVICE

    def allocation(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            "cuMemGetAddressRange",
            self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
        )
        return base.value, size.value

    def export(self, base: int) -> bytes:
        h = Handle()
        code = self.lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base))
        if code != 0:
            raise TransportError(
                f"cuda-ipc: memory at {base:#x} cannot be exported (code {code}): only plain cudaMalloc memory can; "
                "memory from expandable segments cannot (unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
            )
        return bytes(h.reserved)

    def open(self, handle: bytes) -> int:
        h, ptr = Handle(), ctypes.c_uint64()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        self._check(
            "cuIpcOpenMemHandle", self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, self.LAZY_ENABLE_PEER_ACCESS)
        )
        return ptr.value

    def close(self, ptr: int) -> None:
        self._check("cuIpcCloseMemHandle", self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)))

    # ---- the hot path --------------------------------------------------------------------
    def primary_context(self, device: int) -> int:
        """The device's primary context (the one torch and CuPy use), retained."""
        dev, ctx = ctypes.c_int(), _vp()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), device))
        self._check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        return ctx.value

    @contextmanager
    def current(self, ctx: int):
        """`ctx` current on this thread inside the block; the thread's own context after it
        (where it had one: a thread with none keeps `ctx`)."""
        before = _vp()
        self._check("cuCtxGetCurrent", self._get_ctx(ctypes.byref(before)))
        if before.value == ctx:
            yield
            return
        self._check("cuCtxSetCurrent", self._set_ctx(ctx))
        try:
            yield
        finally:
            if before.value:
                self._check("cuCtxSetCurrent", self._set_ctx(before.value))

    def upload(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Pinned host -> device, queued on `stream`."""
        self._check("cuMemcpyHtoDAsync", self._htod(dst, src, nbytes, stream))

    def call(self, function: int, grid: int, block: int, args: tuple[int, ...]) -> "Call":
        """A launch of a kernel whose parameters are all 64-bit (pointers, long long), its
        parameter block packed now so that launching it later is one driver call."""
        return Call(self, function, grid, block, args)

    def synchronize_stream(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._stream_sync(stream))

    def stream_wait(self, stream: int, event: "Event") -> None:
        """Work queued on `stream` from now on starts once `event` has (another stream's write)."""
        self._check("cuStreamWaitEvent", self._stream_wait(stream, event._handle, 0))

    def event(self) -> "Event":
        return Event(self)


class Call:
    """One kernel launch, packed (Driver.call); launch() queues it on a stream."""

    def __init__(self, driver: Driver, function: int, grid: int, block: int, args: tuple[int, ...]):
        self._d, self._function, self._grid, self._block = driver, function, grid, block
        self._values = (ctypes.c_int64 * len(args))(*args)  # kept alive with the pointers into it
        base = ctypes.addressof(self._values)
        self._params = (_vp * len(args))(*(base + 8 * i for i in range(len(args))))

    def launch(self, stream: int) -> None:
        d = self._d
        d._check(
            "cuLaunchKernel",
            d._launch(self._function, self._grid, 1, 1, self._block, 1, 1, 0, stream, self._params, None),
        )


class Event:
    """A blocking-sync event (a waiting thread sleeps, it does not spin), destroyed with this object."""

    def __init__(self, driver: Driver):
        self._d, handle = driver, _vp()
        driver._check("cuEventCreate", driver._ev_create(ctypes.byref(handle), BLOCKING_SYNC | DISABLE_TIMING))
        self._handle = handle.value

    def record(self, stream: int) -> None:
        self._d._check("cuEventRecord", self._d._ev_record(self._handle, stream))

    def query(self) -> bool:
        code = self._d._ev_query(self._handle)
        if code == NOT_READY:
            return False
        self._d._check("cuEventQuery", code)
        return True

    def synchronize(self) -> None:
        self._d._check("cuEventSynchronize", self._d._ev_sync(self._handle))

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            try:
                self._d._ev_destroy(handle)  # a pending event's resources go once it completes
            except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
                pass
