"""Zeroed uint8 buffers for pools and staging areas, on host memory backed by huge pages.

Why: a host buffer the transport writes into (a Mooncake TCP receive copies every byte into
it, a cma write, the scatter out of a staging slot) crosses one TLB entry per 4 KiB page.
torch's CPU allocator asks for no transparent huge pages unless THP_MEM_ALLOC_ENABLE is set,
and on a kernel where THP is "madvise" (the default of most distributions) a buffer gets
them only when advised. Measured (issue 40, 2 cores, `scripts/bench_tp.py --tp 1:1,8:1,8:2
--tokens 1500`, docs/bench_tp_demo_cpu.json: session_15_2_cores_huge_pages): decode's host CPU
per transfer went from ~46-51 ms to ~35-45 at 8:1 and from 15-31 to 10-15 at 1:1; the wall
times stay within the run-to-run noise of this 2-core machine.

So a host buffer of at least HUGE bytes is an anonymous mapping advised MADV_HUGEPAGE before
anything touches it, then written one byte a page at once (the kernel maps, zeroed, a huge
page at its first write, compacting memory for it where it must). Left to the first transfer
that writes a staging slot, that faulting took each of eight senders 17 ms more CPU per send.
Smaller buffers, devices other than the CPU, and systems without madvise get torch.zeros.
"""

import mmap

import torch

HUGE = 2 << 20  # x86-64's transparent huge page; smaller buffers gain nothing


def zeros(nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed uint8 [nbytes] tensor on `device` (host: huge pages where it pays)."""
    if torch.device(device).type != "cpu" or nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # (THP "never", or not built in: ordinary pages, still zeroed)
        pass
    t = torch.frombuffer(region, dtype=torch.uint8)  # (the tensor keeps `region` mapped)
    t[:: mmap.PAGESIZE] = 0  # one byte a page: every page faulted in (zeroed) now, not by the
    return t  # first transfer that writes it
