"""copy_kernel.cu run on the CPU: the kernel source itself, compiled by the host's C++ compiler
behind a shim that stands in for CUDA's few device names, and every launch run thread by
thread over the launch's grid. Every thread of these kernels works alone (no shared memory,
no warp shuffles, no barrier), and no two threads write the same byte of a correct table, so
running the threads one after another gives the bytes the GPU gives: a table and the
kernel's reading of it are proven here, byte for byte, before a GPU sees them.

    shim: uint4, make_uint4, threadIdx / blockIdx / blockDim / gridDim, __ffsll, qualifiers
    emulate(kernel, grid, block, args): for each block, for each thread: kernel(args)
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

from transfer.transports.cuda_layout import Layout

KERNEL = Path(__file__).resolve().parents[2] / "transfer" / "transports" / "copy_kernel.cu"
_SHIM = r"""
#include <cstdint>
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct Dim { unsigned x; };
static Dim threadIdx, blockIdx, blockDim, gridDim;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __noinline__
#define __ffsll __builtin_ffsll
#include "copy_kernel.cu"

extern "C" int emulate(int kernel, long long grid, long long block, const long long* a) {
    gridDim.x = (unsigned)grid;
    blockDim.x = (unsigned)block;
    for (long long b = 0; b < grid; b++)
        for (long long t = 0; t < block; t++) {
            blockIdx.x = (unsigned)b;
            threadIdx.x = (unsigned)t;
            switch (kernel) {
                case 0: copy_ranges((const long long*)a[0], (const long long*)a[1], (const long long*)a[2], a[3]); break;
                case 1: copy_runs((const long long*)a[0], a[1], a[2]); break;
                case 2: copy_lanes((const long long*)a[0], a[1], a[2], a[3], a[4]); break;
                default: return -1;
            }
        }
    return 0;
}
"""
_KERNELS = {"copy_ranges": 0, "copy_runs": 1, "copy_lanes": 2}


# The kernel as built by default, and the copy_lanes variants under measurement (copy_kernel.cu
# names them; scripts/device/bench_lanes.py compiles the same defines on the GPU): every one
# must write the same bytes.
VARIANTS = {
    "default": (),  # (LANE_PREFETCH and LANE_CHUNKS on)
    "old loop": ("LANE_PREFETCH=0", "LANE_CHUNKS=0"),
    "prefetch": ("LANE_CHUNKS=0",),
    "chunks": ("LANE_PREFETCH=0",),
    "prefetch batch 1": ("LANE_CHUNKS=0", "LANE_BATCH=1"),
    "prefetch+chunks batch 3": ("LANE_BATCH=3",),
}


class CpuKernel:
    """The compiled kernels (built once per test session and variant, into `where`), with
    `defines` (NAME=V) as the GPU build would get them."""

    def __init__(self, where: Path, defines: tuple[str, ...] = ()):
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise RuntimeError("a C++ compiler (g++) is needed to run copy_kernel.cu on the CPU")
        (where / "shim.cpp").write_text(_SHIM)
        lib = where / "copy_kernel_cpu.so"
        subprocess.run(
            [compiler, "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
             *(f"-D{d}" for d in defines), f"-I{KERNEL.parent}", str(where / "shim.cpp"), "-o", str(lib)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        self._lib = ctypes.CDLL(str(lib))
        self._lib.emulate.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p)

    def run(self, layout: Layout, blocks: int = 32, threads: int = 512) -> None:
        """Every launch of `layout`, in order, with the grid RangeCopier gives it (the table's
        addresses are this process's memory)."""
        table = np.ascontiguousarray(layout.values, dtype=np.int64)
        base = table.ctypes.data
        for name, rows, ptrs, ints in layout.launches:
            if rows == 0:
                continue
            args = np.array([base + 8 * p for p in ptrs] + list(ints), dtype=np.int64)
            grid = min(blocks, -(-rows * 32 // threads))
            if self._lib.emulate(_KERNELS[name], grid, threads, args.ctypes.data) != 0:
                raise RuntimeError(f"no kernel {name}")
