r"""Between a transformers cache and a request's pool items, one decoder layer at a time.

A layer's cache holds the last T of the request's n tokens (T = n, or window-1 on SWA
layers); in the pool, position p lives at page full_pages[p // P], slot p % P (SWA pages
through the allocator's mapping; kvpool.positions does that math):

    cache keys [1, heads, T, dim]          tokens n-T ... n-1
                     | transpose, rows [first - (n-T), T)
    pool  k view [items, P, heads, dim]    view[items(p), slots(p)] = row,  p in [first, n)

`write_layer` copies positions [first, n) of one layer (prefill: all; a decode step: the new
token) and the layer's state; `read_cache` builds a fresh cache from the pool.

On a pool of one TP shard (kvpool.shards) the model still computes every head, and the pool
holds the rank's units of each split axis: K/V heads, conv channels by group, state heads
(MLA latent and NSA keys whole). `_Shard` knows where they sit in the whole axis:

    cache keys [1, 8 heads, T, dim]     rank 1 of TP 4:  heads 2, 3
    pool view  [items, P, 2, dim]       write: keys[0].index_select(0, idx)
                                        read:  whole.index_copy(0, idx, pool rows)

A rank has only its own units, so `read_cache` takes the others from `whole`, a cache of the
same tokens computed by the model in this process (engine.py says what that checks).
"""

import numpy as np
import torch

from disagg.engine.model.geometry import StateShape
from kvpool import Component, HybridPool, RequestKV
from kvpool.geometry import parts
from kvpool.positions import backed, token_items
from kvpool.shards import Part, global_index


def _items(pool: HybridPool, c: Component, req: RequestKV, positions: np.ndarray):
    items, slots = token_items(pool, c, req, positions)
    keep = backed(items)
    device = pool.config.device
    as_t = lambda a: torch.from_numpy(a[keep].astype(np.int64)).to(device)  # noqa: E731
    return as_t(items), as_t(slots), keep


def _state_item(pool: HybridPool, req: RequestKV) -> int:
    return int(pool.index_set(req)[Component.MAMBA][0])


class _Shard:
    """Per (component, part): int64 indices [local units] into the whole model's split axis
    (on the pool's device), or None where this rank holds the axis whole (TP 1, replicated)."""

    def __init__(self, pool: HybridPool):
        self.pool, self._index = pool, {}

    def index(self, c: Component, layer: int, part: str, axis: int) -> torch.Tensor | None:
        if (c, part) not in self._index:
            self._index[c, part] = self._build(c, layer, part, axis)
        return self._index[c, part]

    def _build(self, c: Component, layer: int, part: str, axis: int) -> torch.Tensor | None:
        cfg = self.pool.config
        if cfg.tp_size == 1:
            return None
        view = self.pool.layer_view(layer, part)  # [items, ..., split axis at `axis`, ...]
        per = view[(0,) * (axis + 1)].numel() * view.element_size()  # bytes of one axis element
        ps = tuple(Part(p.units, p.unit_bytes // per) for p in parts(cfg.model, c, part))
        index = global_index(ps, cfg.tp_size, cfg.tp_rank)
        if len(index) == sum(p.units * p.unit_bytes for p in ps):
            return None
        return torch.from_numpy(index).to(cfg.device)


def _pick(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """This rank's units of t (split axis first)."""
    return t if index is None else t.index_select(0, index.to(t.device))


def _merge(mine: torch.Tensor, whole, index: torch.Tensor | None) -> torch.Tensor:
    """The whole axis: this rank's units from `mine`, the rest from `whole` (split axis first)."""
    return mine if index is None else whole.index_copy(0, index.to(whole.device), mine)


class CacheIO:
    """Knows which layer is which (from the pool's spec) and each linear layer's shapes."""

    def __init__(self, pool: HybridPool, states: dict[int, StateShape]):
        self.pool = pool
        spec = pool.config.model
        self.kinds = spec.layer_kinds()  # attention kind, or linear / none
        self.stateful = set(spec.linear.layers) if spec.linear is not None else set()  # conv + temporal state
        self.nsa_layers = set(spec.nsa.layers) if spec.nsa is not None else set()
        self.window = spec.swa.window if spec.swa is not None else None
        self.states = states
        self.shard = _Shard(pool)
        self.sharded = any(self._split(layer, kind) for layer, kind in enumerate(self.kinds))

    def _split(self, layer: int, kind: str) -> bool:
        """Whether this rank holds only some units of the layer (MLA and NSA: never)."""
        if layer in self.stateful and any(
            self.shard.index(Component.MAMBA, layer, part, 1) is not None for part in ("conv", "temporal")
        ):
            return True
        if kind in ("full", "swa"):
            return self._heads(Component.SWA if kind == "swa" else Component.FULL, layer) is not None
        return False

    def _heads(self, c: Component, layer: int) -> torch.Tensor | None:
        return self.shard.index(c, layer, "k", 2)  # view [items, P, heads, dim]

    # ---- cache -> pool -------------------------------------------------------------------
    def _targets(self, req: RequestKV, layer: int, cl, n: int, first: int):
        """(part, pool view, index into it, this rank's values of the cache) for what layer
        `layer` keeps of positions [first, n) and its state: written by write_layer, compared
        by differences."""
        kind = self.kinds[layer]
        if layer in self.stateful:
            item = _state_item(self.pool, req)
            conv = self.pool.layer_view(layer, "conv")
            conv_index = self.shard.index(Component.MAMBA, layer, "conv", 1)
            # the oldest column transformers keeps is never read: the pool drops it
            yield "conv", conv, (item,), _pick(cl.conv_states[0][0], conv_index)[:, 1:]
            temporal = self.pool.layer_view(layer, "temporal")
            state_index = self.shard.index(Component.MAMBA, layer, "temporal", 1)
            yield (
                "temporal",
                temporal,
                (item,),
                _pick(cl.recurrent_states[0][0], state_index).reshape(temporal.shape[1:]),
            )
        if kind in ("none", "linear"):
            return
        c = Component.SWA if kind == "swa" else Component.FULL
        held = cl.keys.shape[-2]  # the cache holds tokens [n - held, n)
        positions = np.arange(max(first, n - held), n)
        items, slots, keep = _items(self.pool, c, req, positions)
        rows = torch.from_numpy(positions[keep] - (n - held)).to(cl.keys.device)
        if kind == "mla":
            latent = torch.cat([cl.keys[0, 0], cl.values[0, 0]], dim=-1)  # [T, kv_lora_rank + rope]
            yield "latent", self.pool.layer_view(layer, "latent"), (items, slots), latent[rows]
        else:
            heads = self._heads(c, layer)
            yield "k", self.pool.layer_view(layer, "k"), (items, slots), _pick(cl.keys[0], heads).transpose(0, 1)[rows]
            yield (
                "v",
                self.pool.layer_view(layer, "v"),
                (items, slots),
                _pick(cl.values[0], heads).transpose(0, 1)[rows],
            )
        if layer in self.nsa_layers:
            items, slots, keep = _items(self.pool, Component.NSA, req, positions)
            yield "key", self.pool.layer_view(layer, "key"), (items, slots), cl.indexer_keys[0][rows]

    def write_layer(self, req: RequestKV, layer: int, cl, n: int, first: int) -> None:
        for _, view, at, values in self._targets(req, layer, cl, n, first):
            view[at] = values
        if layer in self.nsa_layers:  # unquantized keys: one (unused, 1.0) scale per token
            items, slots, _ = _items(self.pool, Component.NSA, req, np.arange(first, n))
            self.pool.layer_view(layer, "scale")[items, slots] = 1.0

    def differences(self, req: RequestKV, n: int, cache) -> list[str]:
        """Where this rank's bytes in the pool for a request of n tokens differ from this
        rank's units of `cache` (the colocated run's cache of the same n tokens), as
        "layer L part" names; [] where every byte is this rank's shard of it."""
        out = []
        for layer, cl in enumerate(cache.layers):
            for part, view, at, values in self._targets(req, layer, cl, n, 0):
                if not torch.equal(view[at], values.to(view.device)):
                    out.append(f"layer {layer} {part}")
        return out

    # ---- pool -> cache -------------------------------------------------------------------
    def _rows(self, req: RequestKV, c: Component, layer: int, part: str, positions: np.ndarray) -> torch.Tensor:
        items, slots, _ = _items(self.pool, c, req, positions)
        return self.pool.layer_view(layer, part)[items, slots]

    def _kv(self, req: RequestKV, c: Component, layer: int, positions: np.ndarray, ref) -> tuple:
        """K and V [1, heads, T, dim] of `positions`: this rank's heads from the pool."""
        heads = self._heads(c, layer)
        out = []
        for part in ("k", "v"):
            mine = self._rows(req, c, layer, part, positions).transpose(0, 1)
            whole = None if ref is None else (ref.keys if part == "k" else ref.values)[0]
            out.append(_merge(mine, whole, heads).unsqueeze(0).contiguous())
        return tuple(out)

    def read_cache(self, req: RequestKV, n: int, config, whole=None):
        """A transformers cache for n tokens: from nothing but the pool where this rank holds
        every unit (TP 1; MLA/NSA at any TP); else this rank's units from the pool and the rest
        from `whole` (required)."""
        from transformers import DynamicCache

        if self.sharded and whole is None:
            raise ValueError("a TP shard holds part of each layer: read_cache needs the whole cache beside it")
        cache = DynamicCache(config=config)
        for layer, kind in enumerate(self.kinds):
            cl, ref = cache.layers[layer], (whole.layers[layer] if self.sharded else None)
            if layer in self.stateful:
                shape, item = self.states[layer], _state_item(self.pool, req)
                conv = self.pool.layer_view(layer, "conv")[item]
                conv = torch.cat([torch.zeros_like(conv[:, :1]), conv], dim=1)
                conv = _merge(
                    conv,
                    None if ref is None else ref.conv_states[0][0],
                    self.shard.index(Component.MAMBA, layer, "conv", 1),
                )
                cl.update_conv_state(conv.unsqueeze(0))
                temporal = self.pool.layer_view(layer, "temporal")[item].reshape(-1, *shape.recurrent[1:])
                temporal = _merge(
                    temporal,
                    None if ref is None else ref.recurrent_states[0][0],
                    self.shard.index(Component.MAMBA, layer, "temporal", 1),
                )
                cl.update_recurrent_state(temporal.unsqueeze(0).clone())
            if kind == "swa":
                cl.update(*self._kv(req, Component.SWA, layer, np.arange(max(0, n - (self.window - 1)), n), ref))
                cl.cumulative_length = n  # positions of later tokens count every token seen
            elif kind in ("full", "mla"):
                positions = np.arange(n)
                if kind == "full":
                    cl.update(*self._kv(req, Component.FULL, layer, positions, ref))
                else:  # replicated: every rank holds the latent whole
                    latent = self._rows(req, Component.FULL, layer, "latent", positions)
                    rank = latent.shape[-1] - config.qk_rope_head_dim
                    cl.update(latent[None, None, :, :rank].contiguous(), latent[None, None, :, rank:].contiguous())
                if layer in self.nsa_layers:
                    cl.update_indexer(self._rows(req, Component.NSA, layer, "key", positions).unsqueeze(0))
        return cache
