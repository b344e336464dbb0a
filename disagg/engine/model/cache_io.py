r"""Between a transformers cache and a request's pool items, one decoder layer at a time.

A layer's cache holds the last T of the request's n tokens (T = n, or window-1 on SWA
layers); in the pool, position p lives at page full_pages[p // P], slot p % P (SWA pages
through the allocator's mapping; kvpool.positions does that math):

    cache keys [1, heads, T, dim]          tokens n-T ... n-1
                     | transpose, rows [first - (n-T), T)
    pool  k view [items, P, heads, dim]    view[items(p), slots(p)] = row,  p in [first, n)

`write_layer` copies positions [first, n) of one layer (prefill: all; a decode step: the new
token) and the layer's state; `read_cache` builds a fresh cache from the pool alone.
"""

import numpy as np
import torch

from disagg.engine.model.geometry import StateShape
from kvpool import Component, HybridPool, RequestKV
from kvpool.positions import backed, token_items


def _items(pool: HybridPool, c: Component, req: RequestKV, positions: np.ndarray):
    items, slots = token_items(pool, c, req, positions)
    keep = backed(items)
    device = pool.config.device
    as_t = lambda a: torch.from_numpy(a[keep].astype(np.int64)).to(device)  # noqa: E731
    return as_t(items), as_t(slots), keep


def _state_item(pool: HybridPool, req: RequestKV) -> int:
    return int(pool.index_set(req)[Component.MAMBA][0])


class CacheIO:
    """Knows which layer is which (from the pool's spec) and each linear layer's shapes."""

    def __init__(self, pool: HybridPool, states: dict[int, StateShape]):
        self.pool = pool
        spec = pool.config.model
        self.kinds = spec.layer_kinds()
        self.nsa_layers = set(spec.nsa.layers) if spec.nsa is not None else set()
        self.window = spec.swa.window if spec.swa is not None else None
        self.states = states

    # ---- cache -> pool -------------------------------------------------------------------
    def write_layer(self, req: RequestKV, layer: int, cl, n: int, first: int) -> None:
        kind = self.kinds[layer]
        if kind == "none":
            return
        if kind == "linear":
            item = _state_item(self.pool, req)
            conv = self.pool.layer_view(layer, "conv")
            conv[item] = cl.conv_states[0][0, :, 1:]          # drop the column transformers never reads
            temporal = self.pool.layer_view(layer, "temporal")
            temporal[item] = cl.recurrent_states[0][0].reshape(temporal.shape[1:])
            return
        c = Component.SWA if kind == "swa" else Component.FULL
        held = cl.keys.shape[-2]                             # the cache holds tokens [n - held, n)
        positions = np.arange(max(first, n - held), n)
        items, slots, keep = _items(self.pool, c, req, positions)
        rows = torch.from_numpy(positions[keep] - (n - held)).to(cl.keys.device)
        if kind == "mla":
            latent = torch.cat([cl.keys[0, 0], cl.values[0, 0]], dim=-1)     # [T, kv_lora_rank + rope]
            self.pool.layer_view(layer, "latent")[items, slots] = latent[rows]
        else:
            self.pool.layer_view(layer, "k")[items, slots] = cl.keys[0].transpose(0, 1)[rows]
            self.pool.layer_view(layer, "v")[items, slots] = cl.values[0].transpose(0, 1)[rows]
        if layer in self.nsa_layers:
            items, slots, keep = _items(self.pool, Component.NSA, req, positions)
            self.pool.layer_view(layer, "key")[items, slots] = cl.indexer_keys[0][rows]
            self.pool.layer_view(layer, "scale")[items, slots] = 1.0

    # ---- pool -> cache -------------------------------------------------------------------
    def _rows(self, req: RequestKV, c: Component, layer: int, part: str, positions: np.ndarray) -> torch.Tensor:
        items, slots, _ = _items(self.pool, c, req, positions)
        return self.pool.layer_view(layer, part)[items, slots]

    def read_cache(self, req: RequestKV, n: int, config):
        """A transformers cache for n tokens, from nothing but the pool."""
        from transformers import DynamicCache
        cache = DynamicCache(config=config)
        for layer, kind in enumerate(self.kinds):
            cl = cache.layers[layer]
            if kind == "linear":
                shape = self.states[layer]
                conv = self.pool.layer_view(layer, "conv")[_state_item(self.pool, req)]
                cl.update_conv_state(torch.cat([torch.zeros_like(conv[:, :1]), conv], dim=1).unsqueeze(0))
                temporal = self.pool.layer_view(layer, "temporal")[_state_item(self.pool, req)]
                cl.update_recurrent_state(temporal.reshape(1, *shape.recurrent).clone())
            elif kind == "swa":
                positions = np.arange(max(0, n - (self.window - 1)), n)
                k = self._rows(req, Component.SWA, layer, "k", positions).transpose(0, 1).unsqueeze(0)
                v = self._rows(req, Component.SWA, layer, "v", positions).transpose(0, 1).unsqueeze(0)
                cl.update(k, v)
                cl.cumulative_length = n        # positions of later tokens count every token seen
            elif kind in ("full", "mla"):
                positions = np.arange(n)
                if kind == "full":
                    k = self._rows(req, Component.FULL, layer, "k", positions).transpose(0, 1).unsqueeze(0)
                    v = self._rows(req, Component.FULL, layer, "v", positions).transpose(0, 1).unsqueeze(0)
                else:
                    latent = self._rows(req, Component.FULL, layer, "latent", positions)
                    rank = latent.shape[-1] - config.qk_rope_head_dim
                    k, v = latent[None, None, :, :rank], latent[None, None, :, rank:]
                cl.update(k.contiguous(), v.contiguous())
                if layer in self.nsa_layers:
                    cl.update_indexer(self._rows(req, Component.NSA, layer, "key", positions).unsqueeze(0))
        return cache
