r"""A digest of what a pool holds of a request: one int64 per (layer, part, unit), so the two
sides of a transfer can compare the bytes that arrived with the bytes that were written,
whatever the model makes of them (a flip it ignores included).

A component's slots: for each of its segments (layer, part) in the model's order, each
unit of the whole model's row (kvpool.shards: K/V heads, conv channel groups, state heads; a
replicated tensor is one unit). A rank fills the slots of the units it holds:

    slot(layer, part, unit) = wrapping int64 sum, over the kept positions p (paged; a state
        component has none) and every word w of that unit in the row:
            h(layer, part, p, global word offset of w, value of w)

with h one multiply-xorshift round over (value x odd constant) ^ a mixed key of (layer, part,
p, offset): one-to-one in the value, so one flipped bit always changes its slot. Sums over units and positions add up: a TP rank's slots are the whole model's slots of
its units, whichever ranks wrote them (TP resharding), and the positions are token positions,
not pages (page-size pairing). Paged components count the positions a receiver keeps
(kvpool.positions.kept_positions: SWA the window), so both sides count the same ones.
Computed with torch where the pool lives, a layer part at a time; only the slots come back.
"""

import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.geometry import Component, parts, segments
from kvpool.positions import backed, kept_positions, token_items
from kvpool.shards import Part, global_spans, held, units_sent
from kvpool.spec import ModelSpec

_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's multipliers, as int64
_C2 = 0x94D049BB133111EB - (1 << 64)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)
_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_CHUNK = 1 << 22  # words hashed at once (bounds the temporaries)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping multiplies, logical shifts): one-to-one."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


@dataclass(frozen=True)
class Segment:
    """One (layer, part) of a component: its parts' units occupy slots [base, base + units)."""

    layer: int
    part: str
    parts: tuple[Part, ...]
    base: int

    @property
    def units(self) -> int:
        return sum(p.units for p in self.parts)

    @property
    def word(self) -> int:
        """Bytes per hashed word: the widest of 4, 2, 1 that divides every unit."""
        return math.gcd(4, *(p.unit_bytes for p in self.parts))


@functools.lru_cache(maxsize=64)
def layout(model: ModelSpec, c: Component) -> tuple[Segment, ...]:
    """The component's segments and their slots, in the model's order (the same on every rank)."""
    out, base = [], 0
    for seg in segments(model, c, 1, 1):
        ps = parts(model, c, seg.part)
        out.append(Segment(seg.layer, seg.part, ps, base))
        base += sum(p.units for p in ps)
    return tuple(out)


def size(model: ModelSpec, c: Component) -> int:
    last = layout(model, c)[-1]
    return last.base + last.units


def _slots(model: ModelSpec, c: Component, units) -> np.ndarray:
    """The slots of every segment for the units `units(part) -> whole-model unit indices`."""
    out = []
    for seg in layout(model, c):
        first = seg.base
        for p in seg.parts:
            out.append(first + units(p))
            first += p.units
    return np.concatenate(out).astype(np.int64)


def held_slots(model: ModelSpec, c: Component, tp: tuple[int, int]) -> np.ndarray:
    """The slots rank tp = (tp_size, rank) holds."""

    def mine(p: Part) -> np.ndarray:
        first, n = held(p, *tp)
        return np.arange(first, first + n)

    return _slots(model, c, mine)


def sent_slots(model: ModelSpec, c: Component, src: tuple[int, int], dst: tuple[int, int]) -> np.ndarray:
    """The slots source rank src sends to destination rank dst (kvpool.shards.reshard's units)."""
    return _slots(model, c, lambda p: units_sent(p, src, dst))


def slot_name(model: ModelSpec, c: Component, slot: int) -> str:
    """ "full layer 3 v unit 1" (a part of several: "mamba layer 0 conv[2] unit 5")."""
    for seg in layout(model, c):
        if seg.base <= slot < seg.base + seg.units:
            u = slot - seg.base
            for i, p in enumerate(seg.parts):
                if u < p.units:
                    part = seg.part if len(seg.parts) == 1 else f"{seg.part}[{i}]"
                    return f"{c.value} layer {seg.layer} {part} unit {u}"
                u -= p.units
    return f"{c.value} slot {slot}"


@functools.lru_cache(maxsize=1024)
def _columns(seg: Segment, tp: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each word of a rank's row: (its key: a mix of its global word offset and the
    segment, its slot)."""
    w, gwords, slots, first_slot = seg.word, [], [], seg.base
    for (_, g, n), p in zip(global_spans(seg.parts, *tp), seg.parts):
        first, _ = held(p, *tp)
        words = np.arange(g // w, (g + n) // w, dtype=np.int64)
        gwords.append(words)
        slots.append(first_slot + first + np.arange(n // w, dtype=np.int64) // (p.unit_bytes // w))
        first_slot += p.units
    salt = zlib.crc32(f"{seg.layer}/{seg.part}".encode())
    keys = _mix(torch.from_numpy(np.concatenate(gwords)).to(device) * _GOLD + salt)
    return keys, torch.from_numpy(np.concatenate(slots)).to(device)


def _add(out: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, seg: Segment, tp: tuple[int, int]) -> None:
    """Add the hashes of `rows` (a rank's rows of `seg`, one per position) to `out`."""
    keys, slots = _columns(seg, tp, rows.device)
    words = rows.contiguous().view(torch.uint8).reshape(len(rows), -1).view(_WORD[seg.word])
    row_keys = _mix(positions.to(rows.device) * _C2 + zlib.crc32(f"{seg.part}@{seg.layer}".encode()))
    per_word = torch.zeros(words.shape[1], dtype=torch.int64, device=rows.device)
    step = max(1, _CHUNK // max(1, words.shape[1]))
    for i in range(0, len(words), step):
        x = words[i : i + step].to(torch.int64) * _GOLD ^ row_keys[i : i + step, None] ^ keys[None, :]
        x *= _C1  # one round, one-to-one: the keys are mixed already
        x ^= (x >> 32) & ((1 << 32) - 1)
        per_word += x.sum(dim=0)
    out.index_add_(0, slots, per_word)


def compute(pool, req, num_tokens: int) -> dict[Component, np.ndarray]:
    """Each model component's slots over what `req` holds of a request of `num_tokens`
    (int64 [size]; the slots of units this rank does not hold are 0)."""
    cfg = pool.config
    tp, device = (cfg.tp_size, cfg.tp_rank), cfg.device
    out = {}
    for c in pool.pools:
        if c.metadata:
            continue
        sums = torch.zeros(size(cfg.model, c), dtype=torch.int64, device=device)
        at, positions = _rows_at(pool, c, req, num_tokens)
        for seg in layout(cfg.model, c):
            _add(sums, pool.layer_view(seg.layer, seg.part)[at], positions, seg, tp)
        out[c] = sums.cpu().numpy()
    return out


def _rows_at(pool, c: Component, req, num_tokens: int) -> tuple[tuple, torch.Tensor]:
    """(index into a layer view of c, the position of each row it picks): the kept positions
    whose page is backed; a state component's slot, at position 0."""
    device = pool.config.device
    if c.per_request:
        return (torch.tensor([int(pool.index_set(req)[c][0])], device=device),), torch.zeros(1, dtype=torch.int64)
    positions = kept_positions(pool, c, num_tokens)
    items, slots = token_items(pool, c, req, positions)
    keep = backed(items)
    as_t = lambda a: torch.from_numpy(a[keep].astype(np.int64)).to(device)  # noqa: E731
    return (as_t(items), as_t(slots)), torch.from_numpy(positions[keep].astype(np.int64))
