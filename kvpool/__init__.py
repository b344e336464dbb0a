"""Hybrid KV pools (full, SWA, NSA indexer, Mamba state, AUX) and their allocators."""

from kvpool.config import PoolConfig, PoolSizes, resolve_device
from kvpool.cpu_copy import ComponentCopy, KVCopy
from kvpool.errors import AllocatorError, KVPoolError, LayoutMismatch, OutOfSpace, SpecError
from kvpool.geometry import Component, Segment, bytes_per_request, bytes_per_token
from kvpool.indices import INDEX_DTYPE, SENTINEL, IndexSet, padded
from kvpool.layout import Layout
from kvpool.pools import HybridPool, KVPool
from kvpool.presets import PRESETS, get_preset
from kvpool.request import RequestKV
from kvpool.spec import AttentionSpec, LinearStateSpec, MLASpec, ModelSpec, NSAIndexerSpec
from kvpool.storage import BufferDescriptor

__all__ = [
    "PoolConfig", "resolve_device", "PoolSizes", "ComponentCopy", "KVCopy", "AllocatorError", "KVPoolError",
    "LayoutMismatch", "OutOfSpace", "SpecError", "Component", "Segment", "bytes_per_request",
    "bytes_per_token", "INDEX_DTYPE", "SENTINEL", "IndexSet", "padded", "Layout", "HybridPool",
    "KVPool", "PRESETS", "get_preset", "RequestKV", "AttentionSpec", "LinearStateSpec", "MLASpec",
    "ModelSpec", "NSAIndexerSpec", "BufferDescriptor",
]
