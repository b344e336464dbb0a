r"""Tensor-parallel shards: which part of each segment's row one TP rank holds, and which
bytes of it a rank of another TP size needs from it.

A segment's row (one token's K of one layer; a state slot's conv state of one layer) is a
sequence of parts, each `units` units of `unit_bytes` (units: KV heads, SSM heads, conv
channel groups; a replicated tensor is one part of one unit):

    K of 8 heads x 64 dims (bf16)        1 part:   8 units x 128 B
    Mamba2 conv state [x | B | C]        3 parts:  128 heads x (64 ch x width), 8 groups x ..., 8 groups x ...
    MLA latent, NSA keys, the AUX row    1 part:   1 unit (every rank holds it whole)

A rank of TP size T holds, of every part of U units, either U / T consecutive units (T
divides U: rank r holds [r U/T, (r+1) U/T)) or one unit replicated T / U ways (U divides T:
rank r holds unit r // (T/U), as GQA models do when TP exceeds the KV heads). Anything else
is refused. Its row is its parts' units back to back, in part order:

    global row  | x0 x1 x2 x3 | B0 B1 | C0 C1 |        T = 2
    rank 0      | x0 x1 | B0 | C0 |
    rank 1      | x2 x3 | B1 | C1 |

A destination rank takes each unit it holds from exactly one source rank that holds it: the
only holder when the source splits the part; where the source replicates it, the holder
nearest to floor(dst rank x source TP / destination TP), the rank a split part's units come
from. So a replicated tensor's sender is a plan decision, spread over the source ranks and
never an extra sender (TP 1 -> 4: one sender each; 4 -> 1: ranks 0..3, the MLA latent and the
AUX row from rank 0), never "whoever got there first".
"""

from dataclasses import dataclass

import numpy as np

from kvpool.errors import SpecError
from kvpool.spec import check_page_size


@dataclass(frozen=True)
class Shard:
    """One side of a transfer: its pool's page size and TP (size, rank), and whether its items
    are an engine's blocks (kvpool.engine: any block size; kvpool.spec's page rule). A pool's own is PoolConfig.shard; a peer's is built from what it claims, under our
    own pool's rule (SpecError if impossible)."""

    page_size: int
    tp_size: int = 1
    tp_rank: int = 0
    engine_blocks: bool = False

    def __post_init__(self) -> None:
        check_page_size(self.page_size, self.engine_blocks)
        if (
            not isinstance(self.tp_size, int)
            or not isinstance(self.tp_rank, int)
            or not 0 <= self.tp_rank < self.tp_size
        ):
            raise SpecError(f"TP rank {self.tp_rank!r} of size {self.tp_size!r}")

    @property
    def tp(self) -> tuple[int, int]:
        return self.tp_size, self.tp_rank


@dataclass(frozen=True)
class Part:
    units: int  # units in the whole model (heads, groups; 1: replicated)
    unit_bytes: int  # bytes of one unit in one row


def held(part: Part, tp_size: int, tp_rank: int, what: str = "units") -> tuple[int, int]:
    """(first unit, count) of `part` that rank `tp_rank` of `tp_size` holds."""
    u = part.units
    if u >= tp_size:
        if u % tp_size:
            raise SpecError(f"{what} ({u}) not divisible by TP size {tp_size}")
        n = u // tp_size
        return tp_rank * n, n
    if tp_size % u:
        raise SpecError(f"{what} ({u}) neither divisible by nor a divisor of TP size {tp_size}")
    return tp_rank // (tp_size // u), 1


def row_bytes(parts: tuple[Part, ...], tp_size: int, tp_rank: int = 0) -> int:
    """Bytes of one row on a rank (every rank's row is as long)."""
    return sum(held(p, tp_size, tp_rank)[1] * p.unit_bytes for p in parts)


def global_spans(parts: tuple[Part, ...], tp_size: int, tp_rank: int) -> list[tuple[int, int, int]]:
    """(local offset, global offset, bytes) of a rank's row in the whole model's row."""
    out, local, base = [], 0, 0
    for p in parts:
        first, n = held(p, tp_size, tp_rank)
        out.append((local, base + first * p.unit_bytes, n * p.unit_bytes))
        local += n * p.unit_bytes
        base += p.units * p.unit_bytes
    return out


def global_index(parts: tuple[Part, ...], tp_size: int, tp_rank: int) -> np.ndarray:
    """Where each element of a rank's row sits in the whole model's row, with `unit_bytes`
    read as elements per unit (heads along a head axis, channels along a channel axis)."""
    spans = global_spans(parts, tp_size, tp_rank)
    return np.concatenate([np.arange(g, g + n, dtype=np.int64) for _, g, n in spans])


def _units(part: Part, tp_size: int, tp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The units a rank holds and their index within its part's block (int64 arrays)."""
    first, n = held(part, tp_size, tp_rank)
    return np.arange(first, first + n, dtype=np.int64), np.arange(n, dtype=np.int64)


def _sender(part: Part, tp_size: int, units: np.ndarray, dst: tuple[int, int]) -> np.ndarray:
    """The source rank each of `units` is taken from (see the module docstring)."""
    if part.units >= tp_size:
        return units // (part.units // tp_size)
    ways = tp_size // part.units
    natural = dst[1] * tp_size // dst[0]  # the rank that holds a split part's units for dst
    return np.clip(natural, units * ways, units * ways + ways - 1)


def units_sent(part: Part, src: tuple[int, int], dst: tuple[int, int]) -> np.ndarray:
    """The units of `part` (whole-model indices) that source rank src = (tp_size, rank) sends
    to destination rank dst: reshard()'s choice, unit by unit (what a digest per unit follows)."""
    want, _ = _units(part, *dst)
    first, n = held(part, *src)
    return want[(_sender(part, src[0], want, dst) == src[1]) & (want >= first) & (want < first + n)]


def reshard(parts: tuple[Part, ...], src: tuple[int, int], dst: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) slices of a row that source rank src =
    (tp_size, rank) sends to destination rank dst = (tp_size, rank), in destination order,
    adjacent slices merged; [] when it sends none of this segment."""
    (src_tp, src_rank), (dst_tp, dst_rank) = src, dst
    s_base = d_base = 0
    src_off, dst_off, length = [], [], []
    for p in parts:
        want, d_local = _units(p, dst_tp, dst_rank)
        s_first, s_n = held(p, src_tp, src_rank)
        mine = (_sender(p, src_tp, want, dst) == src_rank) & (want >= s_first) & (want < s_first + s_n)
        src_off.append(s_base + (want[mine] - s_first) * p.unit_bytes)
        dst_off.append(d_base + d_local[mine] * p.unit_bytes)
        length.append(np.full(int(mine.sum()), p.unit_bytes, dtype=np.int64))
        s_base += s_n * p.unit_bytes
        d_base += len(want) * p.unit_bytes
    s, d, n = (np.concatenate(a) for a in (src_off, dst_off, length))
    if not len(n):
        return []
    brk = np.flatnonzero((s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])) + 1
    starts = np.concatenate(([0], brk))
    sizes = np.add.reduceat(n, starts)
    return [(int(a), int(b), int(c)) for a, b, c in zip(s[starts], d[starts], sizes)]
