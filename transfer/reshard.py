r"""Which lanes one prefill rank writes into one decode rank: pools of different page sizes
and TP shards of different sizes, paired lane by lane.

    a side    = (page size, TP size, TP rank) of its pool: a Shard
    same TP size, same rank, same page size   -> pages move whole (transfer.plan), no lanes
    same TP size, same rank, other page size  -> every paged segment is one lane on each side
    other TP sizes                            -> every segment (state slots and the AUX row
                                                 too) is cut into the slices kvpool.shards
                                                 assigns this pair; a slice is a lane whose
                                                 rows are part of the segment's rows:

        source row (rank 0 of 1)    | h0 h1 h2 h3 |      lane: offset = segment offset + 2 heads,
        destination row (1 of 2)    | h2 h3 |            token_bytes = 2 heads, stride = 4 heads

    an engine block whose heads are outermost (vLLM's CPU [heads, block, K|V]: a lane per
    head, transfer.engine_rows) pairs whole lanes instead, head for head:

        source lanes (rank 0 of 1)  h0 h1 h2 h3          destination rank 1 of 2 takes h2, h3:
        destination lanes (1 of 2)  h2 h3                its lanes 0, 1 <- source lanes 2, 3

The pairing is a pure function of the model and both shards, so the receiver computes the
same lane lists (a staged piece names a lane by its index in them). A component this pair
has no slice of is absent from the maps: this source rank sends none of it (its unit is
another rank's to send), the AUX row included.
"""

from collections.abc import Mapping

from kvpool.errors import SpecError
from kvpool.geometry import Component, parts, segments
from kvpool.shards import Part, Shard, reshard
from kvpool.spec import ModelSpec
from transfer.errors import LayoutIncompatible
from transfer.tokens import Lane

Lanes = Mapping[Component, tuple[Lane, ...]]
__all__ = [
    "Lanes",
    "Shard",
    "by_token",
    "check_pair",
    "pair_lanes",
    "peer_shard",
    "receivers",
    "senders",
    "side_lanes",
    "unpaired",
]


def peer_shard(
    page_size: int, tp_size: int, tp_rank: int, whose: str = "the peer's", own: Shard | None = None
) -> Shard:
    """The shard a peer claims (untrusted), under `own` pool's page rule (a pool of engine
    blocks takes any block size: kvpool.spec.check_page_size): LayoutIncompatible with the
    reason when impossible."""
    try:
        return Shard(page_size, tp_size, tp_rank, own is not None and own.engine_blocks)
    except SpecError as exc:
        raise LayoutIncompatible(f"{whose} {exc}") from None


def by_token(src: Shard, dst: Shard) -> bool:
    """Whether a pair moves KV by lanes (else whole pages, buffer by buffer)."""
    return src != dst and (src.tp_size != dst.tp_size or src.page_size != dst.page_size)


def check_pair(src: Shard, dst: Shard) -> None:
    """Equal TP sizes pair rank r with rank r only (each holds the same heads); refused otherwise."""
    if src.tp_size == dst.tp_size and src.tp_rank != dst.tp_rank:
        raise LayoutIncompatible(
            f"TP rank {src.tp_rank} of {src.tp_size} holds other heads than rank "
            f"{dst.tp_rank} of {dst.tp_size}: equal TP sizes pair rank r with rank r"
        )


def unpaired(src: Shard, dst: Shard, why: str) -> LayoutIncompatible:
    """The refusal of a pair that must move by token where a side has no token rows (`why`)."""
    return LayoutIncompatible(
        f"block size {src.page_size}, TP {src.tp_size} (sender) vs {dst.page_size}, TP {dst.tp_size} (receiver): {why}"
    )


def pair_lanes(model: ModelSpec, src: Shard, dst: Shard, src_lanes: Lanes, dst_lanes: Lanes) -> tuple[Lanes, Lanes]:
    """(source lanes, destination lanes) per component, lane i of one pairing with lane i of
    the other (same bytes per row). Each side's lanes are its pool's (transfer.tokens.lanes or
    transfer.engine_rows, buffers checked there)."""
    check_pair(src, dst)
    both = [c for c in src_lanes if c in dst_lanes]
    for c in both:
        if src.tp_size != dst.tp_size and list(_streams(src_lanes[c])) != list(_streams(dst_lanes[c])):
            raise LayoutIncompatible(f"{c.value}: the two sides' segments differ")
    mine = side_lanes(model, src, dst, {c: src_lanes[c] for c in both}, 0)
    theirs = side_lanes(model, src, dst, {c: dst_lanes[c] for c in both}, 1)
    for c in mine:
        if len(mine[c]) != len(theirs.get(c, ())):
            raise LayoutIncompatible(f"{c.value}: the two sides' segments differ")
    return mine, theirs


def side_lanes(model: ModelSpec, src: Shard, dst: Shard, lanes: Lanes, side: int) -> Lanes:
    """One side's half of pair_lanes (side 0: the source's, 1: the destination's), from its
    own lanes only: a receiver names the lanes of a sender's pieces without knowing its lanes.
    Same TP sizes: every paged segment whole. Else the slices of every segment this pair
    owns; a head-outer engine segment (lanes per head) by whole heads."""
    check_pair(src, dst)
    if src.tp_size == dst.tp_size:  # only the page size differs: whole segments, paged ones
        return {c: l for c, l in lanes.items() if not c.per_request}
    out: dict[Component, tuple[Lane, ...]] = {}
    for c, ls in lanes.items():
        cut: list[Lane] = []
        slices: dict[tuple[str, bool], list[tuple[int, int, int]]] = {}
        for (_, part), stream in _streams(ls).items():
            per_head = stream[0].head >= 0
            if (part, per_head) not in slices:
                units = parts(model, c, part)
                if per_head:  # offsets and sizes in heads: the lanes of a rank's head i
                    units = tuple(Part(p.units, 1) for p in units)
                slices[part, per_head] = reshard(units, src.tp, dst.tp)
            for sl in slices[part, per_head]:
                off, n = sl[side], sl[2]
                cut += [x for x in stream if off <= x.head < off + n] if per_head else [stream[0].slice(off, n)]
        if cut:
            out[c] = tuple(cut)
    return out


def _streams(lanes: tuple[Lane, ...]) -> dict[tuple[int, str], list[Lane]]:
    """A component's lanes per segment (layer, part), in order (a head-outer one: lanes per head)."""
    out: dict[tuple[int, str], list[Lane]] = {}
    for lane in lanes:
        out.setdefault((lane.layer, lane.part), []).append(lane)
    return out


def receivers(model: ModelSpec, src: Shard, dst_tp: int, components: tuple[Component, ...]) -> tuple[int, ...]:
    """The ranks of a destination instance of TP size `dst_tp` that source rank `src` sends to."""
    return tuple(
        t for t in range(dst_tp) if sends(model, src, Shard(src.page_size, dst_tp, t, src.engine_blocks), components)
    )


def senders(model: ModelSpec, src_tp: int, dst: Shard, components: tuple[Component, ...]) -> tuple[int, ...]:
    """The ranks of a source instance of TP size `src_tp` that send to destination rank `dst`."""
    return tuple(
        t for t in range(src_tp) if sends(model, Shard(dst.page_size, src_tp, t, dst.engine_blocks), dst, components)
    )


def sends(model: ModelSpec, src: Shard, dst: Shard, components: tuple[Component, ...]) -> bool:
    """Whether source rank `src` sends destination rank `dst` anything (equal TP sizes: the
    same rank; else some slice of some segment of `components`)."""
    if src.tp_size == dst.tp_size:
        return src.tp_rank == dst.tp_rank
    return any(
        reshard(parts(model, c, part), src.tp, dst.tp)
        for c in components
        for part in {seg.part for seg in segments(model, c, 1, src.tp_size)}
    )
