"""Hybrid KV pools (full, SWA, NSA indexer, Mamba state, AUX) and their allocators.

Names load on first use (PEP 562), so `from kvpool.presets import PRESETS` or a CLI's
`--help` does not import torch; `from kvpool import HybridPool` does."""

import importlib

_WHERE = {
    **dict.fromkeys(("PoolConfig", "PoolSizes", "resolve_device"), "kvpool.config"),
    **dict.fromkeys(("ComponentCopy", "KVCopy"), "kvpool.cpu_copy"),
    **dict.fromkeys(("AllocatorError", "KVPoolError", "LayoutMismatch", "OutOfSpace", "SpecError"), "kvpool.errors"),
    **dict.fromkeys(("Component", "Segment", "bytes_per_request", "bytes_per_token"), "kvpool.geometry"),
    **dict.fromkeys(("INDEX_DTYPE", "SENTINEL", "IndexSet", "padded"), "kvpool.indices"),
    **dict.fromkeys(("Layout",), "kvpool.layout"),
    **dict.fromkeys(("HybridPool", "KVPool"), "kvpool.pools"),
    **dict.fromkeys(("PRESETS", "get_preset"), "kvpool.presets"),
    **dict.fromkeys(("RequestKV",), "kvpool.request"),
    **dict.fromkeys(("AttentionSpec", "LinearStateSpec", "MLASpec", "ModelSpec", "NSAIndexerSpec"), "kvpool.spec"),
    **dict.fromkeys(("BufferDescriptor",), "kvpool.storage"),
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
