"""Layer groups: a transfer plan cut by model layer, for layer-wise streaming (the sender
writes group g once the engine reports its layers final).

   model layers   0 1 2 3 | 4 5 6 7 | 8 9 10 11        bounds [0, 4, 8, 12]: three groups
   layer-major    group g = the buffers whose layer is in g (whole items)
   by token       group g = the lanes (segments) whose layer is in g (transfer.tokens)
   page-major     group g = the bytes of each row that hold g's layers (a field):
                  | L0.k L0.v ... L3.v | L4.k ... L7.v | L8.k ... L11.v |   one fragment per
                  |<--- group 0 ------>|<-- group 1 -->|<-- group 2 --->|   row and group
"""

import dataclasses
from dataclasses import dataclass

from kvpool.geometry import Component
from kvpool.layout import ALIGN
from transfer.plan import ComponentPlan, TransferPlan

Placement = tuple[int, int, int, int]  # (buffer, layer, byte offset in the item, bytes)


@dataclass(frozen=True)
class LayerGroup:
    layers: range  # the model layers whose KV (and state) this part carries
    body: tuple[ComponentPlan, ...]  # may be empty: no component has a layer in it

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.body)


def _spans(placements: list[Placement], align: int, item_bytes: int) -> list[tuple[int, int]]:
    """Contiguous byte spans covering these placements of one buffer, each taking the
    alignment padding after it along: the groups' spans tile the item, padding included, so a
    streamed row arrives byte for byte as a whole one would."""
    spans: list[list[int]] = []
    for _, _, off, n in sorted(placements, key=lambda p: p[2]):
        end = min(-(-(off + n) // align) * align, item_bytes)
        if spans and off <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([off, end])
    return [(a, b - a) for a, b in spans]


def _whole_streams(cp: ComponentPlan, layers: range) -> ComponentPlan | None:
    """The streams of `cp` (lanes by token, else layer-major buffers) whose layer is in `layers`."""
    streams = cp.src_lanes if cp.by_token else cp.src_bufs
    keep = [i for i, s in enumerate(streams) if s.layer in layers]
    if not keep:
        return None

    def pick(seq):
        return tuple(seq[i] for i in keep)

    sides = (
        dict(src_lanes=pick(cp.src_lanes), dst_lanes=pick(cp.dst_lanes))
        if cp.by_token
        else dict(src_bufs=pick(cp.src_bufs), dst_bufs=pick(cp.dst_bufs))
    )
    return dataclasses.replace(cp, buffer_ids=pick([cp.buffer_id(i) for i in range(cp.streams)]), **sides)


def split_layers(
    plan: TransferPlan, bounds: list[int], placements: dict[Component, list[Placement]], align: int = ALIGN
) -> list[LayerGroup]:
    """The plan's body as consecutive layer groups [bounds[g], bounds[g + 1]): every byte the
    plan moves for a layer lands in exactly one group. `placements` are where each layer's
    segments lie in the sender's items (a buffer that pairs up has the same on the receiver).
    The AUX row belongs to no group: it still goes last."""
    if len(bounds) < 2 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"layer group bounds must increase: {bounds}")
    layers_sent = {b.layer for cp in plan.body for b in cp.src_bufs if b.layer is not None} | {
        p[1] for cp in plan.body if any(b.layer is None for b in cp.src_bufs) for p in placements.get(cp.component, [])
    }
    outside = sorted(l for l in layers_sent if not bounds[0] <= l < bounds[-1])
    if outside:
        raise ValueError(f"layer groups {bounds[0]}..{bounds[-1] - 1} leave out layers {outside}")
    groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    parts: list[list[ComponentPlan]] = [[] for _ in groups]
    for cp in plan.body:
        whole = {bi: b.item_bytes for bi, b in enumerate(cp.src_bufs)}
        for g, layers in enumerate(groups):
            if cp.by_token or all(b.layer is not None for b in cp.src_bufs):  # whole lanes or buffers
                part = _whole_streams(cp, layers)
                if part is not None:
                    parts[g].append(part)
                continue
            for bi in range(len(cp.src_bufs)):  # page-major: a field of each row
                mine = [p for p in placements.get(cp.component, []) if p[0] == bi and p[1] in layers]
                for off, n in _spans(mine, align, whole[bi]):
                    field = None if (off, n) == (0, whole[bi]) else (off, n)
                    parts[g].append(
                        dataclasses.replace(
                            cp,
                            src_bufs=(cp.src_bufs[bi],),
                            dst_bufs=(cp.dst_bufs[bi],),
                            field=field,
                            buffer_ids=(cp.buffer_id(bi),),
                        )
                    )
    return [LayerGroup(layers, tuple(p)) for layers, p in zip(groups, parts)]
