"""vLLM's KV tensors as a disagg pool: what register_kv_caches hands a worker, described as
a kvpool.engine.EnginePool (layer-major buffers over vLLM's own memory, an item per block).

    vLLM's tensor per attention layer                  buffers of layer L
    [num_blocks, num_kv_heads, block_size, 2 * head]   "kv"        (CPU backend: its kernels keep
                                                                     a head's K dim-major, then V)
    [num_blocks, 2, block_size, num_kv_heads, head]    "k+v"       (block-first K/V, FlashInfer)
    [2, num_blocks, block_size, num_kv_heads, head]    "k", "v"    (K/V-first, flash-attention)

    hybrid models (HMA): attention tensors and      one "kv"/"state" buffer per distinct page
    Mamba/GDN state views over one page pool        region (kvpool.engine.shared_pages): block b
                                                    = page b, whichever group holds it

vLLM's block 0 is its null block, as item 0 is our sentinel; whole blocks move as one range
per (block run, buffer) between two sides of the same block size and TP size. Sides of
different block sizes or TP sizes pair by token (transfer.engine_rows: the part says where a
block's rows lie; heads split by transfer.reshard), every KV cache group within itself (full
attention and sliding window: the model names its window layers, disagg.vllm.groups). A model
with state layers whose state is described (a gated-delta-net's: disagg.vllm.states) pairs
other TP sizes too: the state slot's conv and SSM slices move as TP slices of its row, beside
the attention blocks by token; at equal TP sizes only equal block sizes (STATE_SLICES). A
state not described (Mamba1/2, ...) pairs only its own block size and TP (`no_rows`:
STATE_PAGES and why, naming the layer), refused at registration naming both sides.
Layouts whose blocks of one layer are not back to back (BLHNC and other
block-outermost layouts of some CUDA backends: a layer's block b is a strided slice of a
buffer of every layer) are refused by name.
"""

import re
from typing import Any

import torch

from kvpool.engine import EnginePool, EnginePoolConfig, attention_model, block_part, kv_first, shared_pages
from kvpool.errors import SpecError
from kvpool.spec import LinearStateSpec

# vLLM's CPU attention ISAs whose in-block layout transfer.engine_rows describes (a head's K
# dim-major, then its V a row a token), checked against the kernel (tests/vllm_connector/
# test_layout.py); others ("amx", "neon", "vsx", "vxe", "rvv") pair whole blocks only, with
# their own kind
CPU_KERNELS = ("vec", "vec16")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
STATE_PAGES = (
    "a page pool that attention and Mamba/GDN state layers share pairs only its own block size and TP "
    "(start both sides with the same --block-size and TP)"
)
STATE_SLICES = (
    "a state in pages that attention blocks share moves whole or as TP slices: equal TP sizes pair only "
    "equal block sizes (start both sides with the same --block-size)"
)


class VllmLayoutError(ValueError):
    """KV tensors this connector cannot describe yet; the message names the layer and why."""


def layer_index(name: str) -> int:
    m = _LAYER.search(name)
    if m is None:
        raise VllmLayoutError(f"KV cache layer {name!r}: no '.layers.N.' in its name")
    return int(m.group(1))


def geometry(name: str, t: torch.Tensor) -> tuple[str, int, int, int]:
    """(kind, block size, KV heads on this rank, head size) of one layer's tensor; kind is
    "block" (one buffer per layer) or "kv" (K and V buffers)."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
        raise VllmLayoutError(
            f"KV cache layer {name!r}: {type(t).__name__} {tuple(getattr(t, 'shape', ()))} is not a "
            "per-layer attention block tensor (a Mamba/GDN layer's state is described as one)"
        )
    if not t.is_contiguous():
        raise VllmLayoutError(
            f"KV cache layer {name!r}: shape {tuple(t.shape)} strides {t.stride()} is not "
            "contiguous (a block-outermost layout such as BLHNC; use a layer-compact one, "
            "VLLM_KV_CACHE_LAYOUT=LBHNC or NHD)"
        )
    s = t.shape
    if t.dim() == 4:  # [blocks, heads, block_size, 2 * head]
        return "block", s[2], s[1], s[3] // 2
    if s[0] == 2 and s[1] != 2:  # [2, blocks, block_size, heads, head]
        return "kv", s[2], s[3], s[4]
    if s[1] == 2 and s[0] != 2:  # [blocks, 2, block_size, heads, head]
        return "block", s[2], s[3], s[4]
    raise VllmLayoutError(f"KV cache layer {name!r}: shape {tuple(s)}: cannot tell K/V-first from block-first")


def engine_pool(
    kv_caches: dict[str, Any],
    block_size: int,
    model_name: str,
    tp_size: int = 1,
    tp_rank: int = 0,
    state_layers: frozenset[str] = frozenset(),
    *,
    window_layers: frozenset[str] = frozenset(),
    window: int = 0,
    state: LinearStateSpec | None = None,
    state_refusal: str = "",
    cpu_kernel: str = "",
) -> EnginePool:
    """vLLM's tensors (register_kv_caches) as one EnginePool, buffers in layer order (so both
    sides number their regions alike). `state_layers`: the Mamba/GDN layers (a state tensor,
    or a list of them, per layer; `state`: their geometry, disagg.vllm.states, or None and
    `state_refusal` saying why); `window_layers`: the sliding-window ones (`window`: the
    longest window); every other layer is full attention. Raises VllmLayoutError naming the
    first layer that cannot be described, or that differs from the others."""
    named = sorted(((layer_index(n), n, t) for n, t in kv_caches.items()), key=lambda x: x[0])
    if len({i for i, _, _ in named}) != len(named):
        raise VllmLayoutError(f"two KV cache tensors for one layer: {sorted(kv_caches)}")
    attention = [(i, n, t) for i, n, t in named if n not in state_layers]
    if not attention:
        raise VllmLayoutError("no attention KV cache tensors (a model of state layers only is not described yet)")
    shapes = {geometry(n, t) + (t.dtype,) for _, n, t in attention}
    if len(shapes) != 1:
        raise VllmLayoutError(f"attention KV cache layers of different shapes or dtypes {sorted(map(str, shapes))}")
    kind, bs, heads, head, dtype = shapes.pop()
    if bs != block_size:
        raise VllmLayoutError(f"KV cache tensors hold blocks of {bs} tokens, vLLM's block size is {block_size}")
    try:
        if kind == "kv":
            if len(attention) != len(named):
                raise VllmLayoutError("a K/V-first attention layout beside state layers is not described yet")
            bufs = [b for i, _, t in attention for b in kv_first(i, t)]
        else:
            part = lambda t: _kernel_part(block_part(t), cpu_kernel)  # noqa: E731
            bufs = shared_pages([(i, part(t), t) for i, _, t in attention] + list(_states(named, state_layers)))
        model = attention_model(
            model_name,
            [i for i, _, _ in attention],
            heads * tp_size,
            head,
            dtype,
            named[-1][0] + 1,
            window_layers=[i for i, n, _ in attention if n in window_layers],
            window=window,
            linear=state if len(attention) != len(named) else None,
        )
        config = EnginePoolConfig(model, block_size, attention[0][2].device, tp_size, tp_rank)
        if any(b.part.startswith("kv@") for b in bufs):  # a CPU kernel's blocks whose rows are not described
            return EnginePool(config, bufs, no_rows=_kernel_refusal(cpu_kernel))
        if len(attention) == len(named):
            return EnginePool(config, bufs)
        if model.linear is None:
            return EnginePool(config, bufs, no_rows=f"{STATE_PAGES}: {state_refusal or 'its state is not described'}")
        return EnginePool(config, bufs, whole_states=STATE_SLICES)
    except SpecError as exc:
        raise VllmLayoutError(str(exc)) from None


def _kernel_part(part: str, cpu_kernel: str) -> str:
    """A CPU block's part, named with its kernel where that kernel's in-block layout is not the
    one transfer.engine_rows describes: two sides pair whole blocks only when their kernels
    match (layout_difference names the parts)."""
    return f"{part}@{cpu_kernel}" if part == "kv" and cpu_kernel and cpu_kernel not in CPU_KERNELS else part


def _kernel_refusal(cpu_kernel: str) -> str:
    return (
        f"vLLM's CPU attention kernel {cpu_kernel!r} keeps a block's rows in a layout not described here "
        f"(by-token pairing is checked against {', '.join(CPU_KERNELS)}): start both sides with the same "
        "--block-size and TP on the same kind of CPU"
    )


def _states(named, state_layers):
    """(layer, "state", tensor) of each state tensor of the state layers."""
    for i, n, t in named:
        if n in state_layers:
            for x in t if isinstance(t, (list, tuple)) else (t,):
                if not isinstance(x, torch.Tensor) or x.dim() < 2:
                    raise VllmLayoutError(f"state layer {n!r}: {type(x).__name__} is not a block-major tensor")
                yield i, "state", x
