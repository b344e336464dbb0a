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

The pairing is a pure function of the model and both shards, so the receiver computes the
same lane lists (a staged piece names a lane by its index in them). A component this pair
has no slice of is absent from the maps: this source rank sends none of it (its unit is
another rank's to send), the AUX row included.
"""

from collections.abc import Mapping

from kvpool.errors import SpecError
from kvpool.geometry import Component, parts, segments
from kvpool.shards import Shard, reshard
from kvpool.spec import ModelSpec
from transfer.errors import LayoutIncompatible
from transfer.tokens import Lane

Lanes = Mapping[Component, tuple[Lane, ...]]
__all__ = ["Lanes", "Shard", "by_token", "check_pair", "pair_lanes", "peer_shard", "receivers", "senders"]


def peer_shard(
    page_size: int, tp_size: int, tp_rank: int, whose: str = "the peer's", own: Shard | None = None
) -> Shard:
    """The shard a peer claims (untrusted), under `own` pool's page rule (a pool of whole engine
    blocks takes any block size: it pairs only with its own): LayoutIncompatible with the
    reason when impossible."""
    try:
        return Shard(page_size, tp_size, tp_rank, own is not None and own.whole_blocks)
    except SpecError as exc:
        raise LayoutIncompatible(f"{whose} {exc}") from None


def by_token(src: Shard, dst: Shard) -> bool:
    """Whether a pair moves KV by lanes (else whole pages, buffer by buffer)."""
    return src != dst and (src.tp_size != dst.tp_size or src.page_size != dst.page_size)


def check_pair(src: Shard, dst: Shard) -> None:
    """Equal TP sizes pair rank r with rank r only (each holds the same heads), and a pool of
    whole engine blocks (no token rows to cut) only its own block size and TP size; refused otherwise."""
    if (src.whole_blocks or dst.whole_blocks) and by_token(src, dst):
        raise LayoutIncompatible(
            f"block size {src.page_size}, TP {src.tp_size} (sender) vs {dst.page_size}, TP "
            f"{dst.tp_size} (receiver): engine KV caches pair only equal block sizes and TP sizes "
            "(start both sides with the same --block-size and TP)"
        )
    if src.tp_size == dst.tp_size and src.tp_rank != dst.tp_rank:
        raise LayoutIncompatible(
            f"TP rank {src.tp_rank} of {src.tp_size} holds other heads than rank "
            f"{dst.tp_rank} of {dst.tp_size}: equal TP sizes pair rank r with rank r"
        )


def pair_lanes(model: ModelSpec, src: Shard, dst: Shard, src_lanes: Lanes, dst_lanes: Lanes) -> tuple[Lanes, Lanes]:
    """(source lanes, destination lanes) per component, lane i of one pairing with lane i of
    the other (same bytes per row). Each side's lanes are its pool's (transfer.tokens.lanes,
    buffers checked there)."""
    check_pair(src, dst)
    if src.tp_size == dst.tp_size:  # only the page size differs: whole segments, paged ones
        keep = [c for c in src_lanes if not c.per_request and c in dst_lanes]
        return {c: src_lanes[c] for c in keep}, {c: dst_lanes[c] for c in keep}
    out_src: dict[Component, tuple[Lane, ...]] = {}
    out_dst: dict[Component, tuple[Lane, ...]] = {}
    for c, s_lanes in src_lanes.items():
        d_lanes = dst_lanes.get(c)
        if d_lanes is None:
            continue
        if len(s_lanes) != len(d_lanes) or any(
            (a.layer, a.part) != (b.layer, b.part) for a, b in zip(s_lanes, d_lanes)
        ):
            raise LayoutIncompatible(f"{c.value}: the two sides' segments differ")
        a_out, b_out = [], []
        slices = {part: reshard(parts(model, c, part), src.tp, dst.tp) for part in {a.part for a in s_lanes}}
        for a, b in zip(s_lanes, d_lanes):
            for s_off, d_off, n in slices[a.part]:
                a_out.append(a.slice(s_off, n))
                b_out.append(b.slice(d_off, n))
        if a_out:
            out_src[c], out_dst[c] = tuple(a_out), tuple(b_out)
    return out_src, out_dst


def receivers(model: ModelSpec, src: Shard, dst_tp: int, components: tuple[Component, ...]) -> tuple[int, ...]:
    """The ranks of a destination instance of TP size `dst_tp` that source rank `src` sends to."""
    return tuple(
        t for t in range(dst_tp) if sends(model, src, Shard(src.page_size, dst_tp, t, src.whole_blocks), components)
    )


def senders(model: ModelSpec, src_tp: int, dst: Shard, components: tuple[Component, ...]) -> tuple[int, ...]:
    """The ranks of a source instance of TP size `src_tp` that send to destination rank `dst`."""
    return tuple(
        t for t in range(src_tp) if sends(model, Shard(dst.page_size, src_tp, t, dst.whole_blocks), dst, components)
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
