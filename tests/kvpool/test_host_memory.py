"""Host buffers on huge pages (kvpool/host_memory.py): zeroed, writable, and advised, which the
kernel's own account of the mapping shows (/proc/self/smaps)."""

from pathlib import Path

import torch

from kvpool import HybridPool, PoolConfig, get_preset, host_memory
from transfer.staging import StagingArea


def _mapping(ptr: int) -> dict[str, str]:
    """The smaps fields of the mapping holding address `ptr`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_a_large_host_buffer_is_zeroed_writable_and_advised_for_huge_pages():
    t = host_memory.zeros(6 << 20)
    assert t.dtype == torch.uint8 and t.shape == (6 << 20,) and t.device.type == "cpu"
    assert not t.any()
    t[123] = 7
    assert int(t[123]) == 7 and int(t.sum()) == 7
    flags = _mapping(t.data_ptr())["VmFlags"].split()
    assert "hg" in flags  # MADV_HUGEPAGE, as the kernel records it
    if _thp_mode() != "never":
        assert _mapping(t.data_ptr())["THPeligible"] == "1"


def test_small_buffers_and_other_devices_are_plain_torch_zeros():
    small = host_memory.zeros(4096)
    assert not small.any() and small.shape == (4096,)
    # torch's own allocation (resizable), not a mapping of ours; its mapping's flags prove nothing: numpy
    # advises huge pages on its own large allocations, and the heap may reuse that memory for small ones
    assert small.untyped_storage().resizable() and not host_memory.zeros(6 << 20).untyped_storage().resizable()
    meta = host_memory.zeros(8 << 20, "meta")
    assert meta.device.type == "meta" and meta.shape == (8 << 20,)


def test_a_pools_and_a_staging_areas_buffers_live_on_advised_memory():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 16, max_tokens=65536, max_requests=4))
    buffers = [b for bs in pool.exposed_tensors().values() for b in bs]
    big = [b for b in buffers if b.numel() >= host_memory.HUGE]
    assert big and all("hg" in _mapping(b.data_ptr())["VmFlags"].split() for b in big)
    assert all(not b.any() for b in buffers)
    area = StagingArea(2, 4 << 20, "cpu")
    assert "hg" in _mapping(area.ptr)["VmFlags"].split() and not area.buffer.any()
