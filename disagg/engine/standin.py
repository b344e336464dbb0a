"""The stand-in engine: deterministic KV with no model weights, so the whole path can be run,
tested and benchmarked. A real model engine implements the same interface (engine/base.py).

Every byte of a token's KV is a function of (token id, position, layer, component, byte):

    seed[t]  = mix(token_ids[t], t, layer, component)          uint32 per token
    word[t,j] = seed[t] * (2j + 1) + j * 0x9E3779B1 (uint32)    j = 4-byte word in the segment

so a misplaced page, a stale page or a swapped layer changes the bytes. Linear-state slots
take the seed of the whole prompt. j counts bytes of the whole model's row: a TP rank holds
the bytes of its heads (kvpool.shards), so KV resharded between TP sizes verifies on decode.
Loops run over layers and parts, never over tokens. The per-token bytes are computed, written
and checked with torch on the pool's device (on a GPU pool, nothing crosses to the host but a
few checksums); numpy's _mix/_bytes_for are the reference the torch versions are tested
against.
"""

import functools
import time
import zlib

import numpy as np
import torch

from disagg.engine.base import (
    DecodeOutput,
    PrefillResult,
    PrefillReuse,
    check_aux,
    compare_tokens,
    prompt_digest,
    stop_if,
)
from disagg.errors import VerifyError
from kvpool import Component, HybridPool, RequestKV
from kvpool.geometry import parts
from kvpool.positions import backed, kept_positions, paged_components, state_components, token_items
from kvpool.shards import global_index, row_bytes


def _mix(*parts: np.ndarray | int) -> np.ndarray:
    h = np.uint64(0xCBF29CE484222325)
    out = np.full(np.broadcast(*[np.asarray(p) for p in parts]).shape, h, dtype=np.uint64)
    for p in parts:
        out ^= np.asarray(p, dtype=np.uint64)
        out *= np.uint64(0x100000001B3)
        out ^= out >> np.uint64(29)
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _bytes_for(seeds: np.ndarray, nbytes: int) -> np.ndarray:
    """uint8 [len(seeds), nbytes], four bytes per arithmetic op."""
    j = np.arange(-(-nbytes // 4), dtype=np.uint32)
    words = seeds[:, None] * (2 * j + 1)[None, :] + (j * np.uint32(0x9E3779B1))[None, :]
    return words.view(np.uint8)[:, :nbytes]


_FNV = 0xCBF29CE484222325 - (1 << 64)  # the same 64-bit constants as int64 (two's complement)
_LOW35 = (1 << 35) - 1  # >> 29 on int64 keeps 35 bits: a logical shift


def _mix_t(*parts) -> torch.Tensor:
    """_mix on int64 tensors (any device): wrapping multiplies, logical shifts; uint32 values."""
    shape = torch.broadcast_shapes(*[p.shape for p in parts if isinstance(p, torch.Tensor)])
    device = next(p.device for p in parts if isinstance(p, torch.Tensor))
    out = torch.full(shape, _FNV, dtype=torch.int64, device=device)
    for p in parts:
        out ^= p
        out *= 0x100000001B3
        out ^= (out >> 29) & _LOW35
    return out & 0xFFFFFFFF


def _bytes_for_t(seeds: torch.Tensor, nbytes: int) -> torch.Tensor:
    """_bytes_for on the seeds' device: uint8 [len(seeds), nbytes]."""
    j = torch.arange(-(-nbytes // 4), dtype=torch.int64, device=seeds.device)
    words = (seeds[:, None] * (2 * j + 1)[None, :] + (j * 0x9E3779B1)[None, :]) & 0xFFFFFFFF
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # exact, no overflow
    return words.view(torch.uint8).reshape(len(seeds), 4 * len(j))[:, :nbytes]  # (no seeds: no rows)


def first_token(token_ids: np.ndarray) -> int:
    return int(_mix(int(prompt_digest(token_ids)[0]), len(token_ids))[()] % 50000)


def next_token(previous: int, num_tokens: int) -> int:
    """The stand-in's token rule: the token after `previous`, once the request holds num_tokens."""
    return int(_mix(previous, num_tokens)[()] % 50000)


def _put(view: torch.Tensor, data: np.ndarray) -> None:
    view.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(data).to(view.device))


def _salt(name: str) -> int:
    """A per-component (or per-part) constant, derived from the name: no table to extend."""
    return zlib.crc32(name.encode())


class StandInEngine:
    """Loops over the pool's components as kvpool.positions describes them; it names none."""

    name = "standin"
    spec = None  # fills any preset
    vocab_size = None  # takes any token id
    byte_digest = False  # decode recomputes every byte it holds (verify): stronger than a digest
    exact_reuse = True  # a position's KV is a function of its token and position alone
    reuse_note = "standin: a position's KV is a function of its token and position: decode may reuse all it holds"

    def __init__(self, layer_ms: float = 0.0):
        self.layer_ms = layer_ms  # simulated compute per layer in prefill (0: none)

    def _expected(
        self,
        layer: int,
        c: Component,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        nbytes: int,
        cols: tuple | None = None,
    ):
        """uint8 [len(positions), nbytes] on the tensors' device: a TP shard's row (`cols`) is
        its bytes of the whole model's row, so a resharded row verifies on any rank."""
        if cols is None:
            return _bytes_for_t(_mix_t(token_ids[positions], positions, layer, _salt(c.value)), nbytes)
        index, whole = cols
        rows = _bytes_for_t(_mix_t(token_ids[positions], positions, layer, _salt(c.value)), whole)
        return rows[:, index.to(rows.device)]

    @staticmethod
    def _columns(pool: HybridPool, c: Component, part: str) -> tuple | None:
        """(bytes of the whole model's row this rank's row holds, the whole row's length);
        None on a pool of one shard (kvpool.shards)."""
        cfg = pool.config
        if cfg.tp_size == 1:
            return None
        ps = parts(cfg.model, c, part)
        return torch.from_numpy(global_index(ps, cfg.tp_size, cfg.tp_rank)), row_bytes(ps, 1)

    def _parts(self, pool: HybridPool, c: Component):
        for pl in pool.pools[c].storage.packed.placements:
            yield pl.segment.layer, pl.segment.part, pool.layer_view(pl.segment.layer, pl.segment.part)

    @staticmethod
    def _token_bytes(view: torch.Tensor) -> tuple[torch.Tensor, int]:
        """[items, page_size, bytes per token] uint8 view of a paged layer view."""
        per_token = view[0, 0].numel() * view.element_size()
        raw = view.view(torch.uint8) if view.dim() > 2 else view.unsqueeze(-1).view(torch.uint8)
        return raw.reshape(view.shape[0], view.shape[1], per_token), per_token

    def _writes(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, positions: np.ndarray) -> list:
        """(layer, write) for every (layer, part) of every paged component: write() puts that
        part's bytes for `positions` into the pool."""
        device = pool.config.device
        tokens = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(device)
        out = []
        for c in paged_components(pool):
            items, slots = token_items(pool, c, req, positions)
            keep = backed(items)  # only positions whose page the component still holds
            pos = torch.from_numpy(positions[keep].astype(np.int64)).to(device)
            it = torch.from_numpy(items[keep].astype(np.int64)).to(device)
            sl = torch.from_numpy(slots[keep].astype(np.int64)).to(device)
            for layer, part, view in self._parts(pool, c):
                cols = self._columns(pool, c, part)
                out.append(
                    (layer, functools.partial(self._write_part, view, layer, c, tokens, pos, it, sl=sl, cols=cols))
                )
        return out

    def _write_part(self, view, layer: int, c: Component, tokens, pos, it, *, sl, cols) -> None:
        raw, per_token = self._token_bytes(view)
        raw[it, sl] = self._expected(layer, c, tokens, pos, per_token, cols)

    def _write_tokens(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, positions: np.ndarray) -> None:
        for _, write in self._writes(pool, req, token_ids, positions):
            write()

    def _state_writes(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray) -> list:
        out = []
        for c in state_components(pool):
            item = self._state_item(pool, c, req)
            for layer, part, data in self._state_bytes(pool, c, token_ids):
                view = pool.layer_view(layer, part)[item]
                out.append((layer, functools.partial(_put, view, data)))
        return out

    def _state_bytes(self, pool: HybridPool, c: Component, token_ids: np.ndarray):
        seed = _mix(int.from_bytes(prompt_digest(token_ids)[:4], "little"), len(token_ids))
        for pl in pool.pools[c].storage.packed.placements:
            s = _mix(seed, pl.segment.layer, _salt(pl.segment.part), _salt(c.value))
            cols = self._columns(pool, c, pl.segment.part)
            data = _bytes_for(np.atleast_1d(s), pl.segment.nbytes if cols is None else cols[1])[0]
            yield pl.segment.layer, pl.segment.part, data if cols is None else data[cols[0].numpy()]

    @staticmethod
    def _state_item(pool: HybridPool, c: Component, req: RequestKV) -> int:
        return int(pool.index_set(req)[c][0])

    # ---- ModelEngine ---------------------------------------------------------------------
    def prefill(
        self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int, on_layer=None, *, cached: int = 0
    ) -> PrefillResult:
        """Layer by layer, as a forward pass goes: every part of layer i (KV of every
        position from `cached` on, its state), then `layer_ms` of simulated compute (its share
        of the positions computed: a cached prefix costs none), then on_layer(i)."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        by_layer: dict[int, list] = {}
        for layer, write in self._writes(pool, req, token_ids, np.arange(cached, len(token_ids))) + self._state_writes(
            pool, req, token_ids
        ):
            by_layer.setdefault(layer, []).append(write)
        for layer in range(pool.config.model.num_layers):
            for write in by_layer.get(layer, ()):
                write()
            if self.layer_ms:  # the compute a real layer would take (benchmarks, tests)
                time.sleep(self.layer_ms / 1e3 * (len(token_ids) - cached) / len(token_ids))
            if on_layer is not None:
                on_layer(layer)
        result = PrefillResult(first_token(token_ids), prompt_digest(token_ids))
        pool.aux.write(req.aux_row, room, len(token_ids), result.first_token, result.digest)
        return result

    def reusable(self, prompt_len: int, held: int) -> int:
        return held

    def prefill_reuse(self, pool: HybridPool) -> PrefillReuse:
        return PrefillReuse(
            1, "standin: a position's KV is a function of its token and position: prefill skips any cached prefix"
        )

    def verify(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int) -> None:
        """check_aux, then every byte it holds against the bytes of this prompt, recomputed."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        n = len(token_ids)
        check_aux(pool, req, token_ids, room, lambda token: token == first_token(token_ids))
        device = pool.config.device
        tokens = torch.from_numpy(token_ids).to(device)
        for c in paged_components(pool):
            positions = kept_positions(pool, c, n)  # what the receiver holds (SWA: the window)
            items, slots = token_items(pool, c, req, positions)
            pos = torch.from_numpy(positions.astype(np.int64)).to(device)
            it = torch.from_numpy(items.astype(np.int64)).to(device)
            sl = torch.from_numpy(slots.astype(np.int64)).to(device)
            for layer, part, view in self._parts(pool, c):
                raw, per_token = self._token_bytes(view)
                got = raw[it, sl]
                want = self._expected(layer, c, tokens, pos, per_token, self._columns(pool, c, part))
                if not torch.equal(got, want):
                    bad = int(torch.nonzero((got != want).any(dim=1))[0, 0])
                    raise VerifyError(
                        f"{c.value} layer {layer} {part}: token at position {int(positions[bad])} differs"
                    )
        for c in state_components(pool):
            item = self._state_item(pool, c, req)
            for layer, part, want in self._state_bytes(pool, c, token_ids):
                got = pool.layer_view(layer, part)[item].reshape(-1).view(torch.uint8).cpu().numpy()
                if not np.array_equal(got, want):
                    raise VerifyError(f"{c.value} layer {layer} {part} differs")

    def decode(
        self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, max_new_tokens: int, stop=None
    ) -> DecodeOutput:
        tokens = list(np.asarray(token_ids, dtype=np.int64))
        out = [first_token(np.asarray(token_ids))]
        for step in range(1, max_new_tokens):
            stop_if(stop, step)
            tokens.append(out[-1])
            pool.extend(req, len(tokens))  # allocates pages, evicts out-of-window SWA pages
            arr = np.asarray(tokens, dtype=np.int64)
            self._write_tokens(pool, req, arr, np.array([len(arr) - 1]))
            out.append(next_token(out[-1], len(arr)))
        return DecodeOutput(out)

    def check(self, token_ids: np.ndarray, output: DecodeOutput) -> dict:
        """The stand-in's colocated run is its token rule applied without a pool."""
        n = len(token_ids)
        want = [first_token(np.asarray(token_ids))]
        for i in range(len(output.tokens) - 1):
            want.append(next_token(want[-1], n + i + 1))
        return compare_tokens(want, output.tokens)
