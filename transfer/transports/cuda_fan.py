"""A fan-out over cuda-ipc: one request's writes from this process into several peers at once
(one prefill rank's pages into every decode rank of a larger TP), as one table, one upload,
one launch sequence and one event, where each peer's write alone was all of that once per peer
under one GIL (one H100, 1:8 at 32k: ~1 ms of host time per send, eight of them in turn).

    per peer: its link's groups (a body, its AUX row), runsets of that peer's lanes
      -> lanes merged: LaneRuns of different peers that share their runs (the same arrays:
         transfer.plan.relane planned them once) become one LaneRuns whose lanes are every
         peer's, so one copy_lanes launch covers them all
      -> key (the merged runsets and the links' serials) -> the fan's table cache; a miss:
         every peer's runsets checked against that peer's own regions (work()), addresses
         concatenated in the merged lanes' order, laid out, uploaded on the fan's stream
      start: under every link's lock (none closed, or PeerUnreachable and nothing runs), the
         fan's stream waits for each link's last write, the launches and one event; each
         link's stream then waits for that event (its later writes land after, and close()
         waits for it before unmapping); one PendingWrite per peer, all ending together

Addresses in a merged table are absolute, so the table is only ever launched with the links it
was laid out for, all open: its key names their serials (never reused), and start() checks.
"""

import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack

import numpy as np

from transfer.errors import PeerUnreachable, TransportError
from transfer.transports.base import PendingWrite
from transfer.transports.cuda_copy import Table, TableCache
from transfer.transports.cuda_layout import LayoutKey, lay_out, layout_key, work
from transfer.transports.pace import Pace, Watch
from transfer.transports.ranges import LANE_FIELDS, LaneRuns

_RUN_FIELDS = ("src_start", "dst_start", "count")


def merge(parts: Sequence[tuple[object, Sequence]]) -> list[list[tuple[LaneRuns, list]]]:
    """Per group, the parts' runsets merged: [(runset, [(part index, its runset)])], LaneRuns
    sharing their runs (the same arrays, and rows per page) as one runset of all their lanes,
    in part order; any other runset alone."""
    out = []
    for g in range(max(len(groups) for _, groups in parts)):
        merged: dict[tuple, list] = {}
        for i, (_, groups) in enumerate(parts):
            for rs in groups[g] if g < len(groups) else ():
                if not len(rs.count):
                    continue
                key = (
                    (*(id(getattr(rs, f)) for f in _RUN_FIELDS), rs.src_rows, rs.dst_rows)
                    if isinstance(rs, LaneRuns)
                    else (id(rs),)
                )
                merged.setdefault(key, []).append((i, rs))
        out.append([(_joined([rs for _, rs in members]), members) for members in merged.values()])
    return out


def _joined(sets: list) -> object:
    if len(sets) == 1:
        return sets[0]
    first = sets[0]
    lanes = {f: np.concatenate([getattr(rs, f) for rs in sets]) for f in LANE_FIELDS}
    return LaneRuns(
        first.src_start, first.dst_start, first.count, **lanes, src_rows=first.src_rows, dst_rows=first.dst_rows
    )


def checked_work(links: Sequence, merged: list[list[tuple[object, list]]]) -> list[list[tuple]]:
    """The merged groups as kernel work: each member checked against its own link's regions
    (OutOfBounds), its lanes' addresses concatenated in the merged order."""
    out = []
    for group in merged:
        items = []
        for rs, members in group:
            done = [work([m], links[i]._ours, links[i]._theirs) for i, m in members]
            if any(not d for d in done):
                continue
            items.append((rs, *(np.concatenate([d[0][k] for d in done]) for k in (1, 2))))
        out.append(items)
    return out


class FanWriter:
    """A transport's fan-outs: their stream (its own: no link's), table cache and pace."""

    def __init__(self, transport, gbps: float, make_write) -> None:
        import torch

        self._t, self._make_write = transport, make_write  # make_write: cuda_ipc.CudaWrite
        self._stream = torch.cuda.Stream(transport.device)
        self._tables = TableCache(transport.driver)
        self._pace = Pace(gbps)
        self._last = None  # the last fan's event
        self._lock = threading.Lock()

    def prepare(self, parts: Sequence[tuple[object, Sequence]]) -> "FanPrepared":
        """parts: (a link of this transport, its groups of runsets), one per peer. Raises
        OutOfBounds (a peer's range outside its regions: nothing is launched for any),
        PeerUnreachable (a link closed)."""
        links = [link for link, _ in parts]
        if any(link._closed for link in links):
            raise PeerUnreachable("write", -1, "a fan-out's peer", detail="a link is closed")
        merged = merge(parts)
        base = layout_key([[rs for rs, _ in g] for g in merged])
        key = LayoutKey((tuple(link.serial for link in links), base.digest), base.values)
        table = self._tables.find(key)
        if table is None:
            layout = lay_out(checked_work(links, merged))
            if not len(layout.values):
                raise ValueError("a fan-out with nothing to write")
            copier = self._t.copier
            try:
                with self._t.driver.current(copier.context()):
                    table = copier.prepare(key, layout, self._stream, self._tables)
            except RuntimeError as exc:
                raise TransportError(f"cuda-ipc: laying out a fan-out failed: {exc}") from exc
        sizes = [sum(rs.nbytes for g in groups for rs in g) for _, groups in parts]
        return FanPrepared(self, links, table, sizes)

    def start(self, links: Sequence, table: Table, sizes: Sequence[int]) -> list[PendingWrite]:
        driver, stream = self._t.driver, self._stream.cuda_stream
        with ExitStack() as held:
            for link in sorted(set(links), key=lambda x: x.serial):
                held.enter_context(link._lock)
            if any(link._closed for link in links):  # its mapping is gone: nothing runs
                raise PeerUnreachable("write", -1, "a fan-out's peer", detail="a link is closed")
            with driver.current(self._t.copier.context()):
                alone = all(x is None or x.query() for x in [self._last, *(link._last for link in links)])
                started = time.perf_counter()
                for link in links:
                    if link._last is not None:
                        driver.stream_wait(stream, link._last)
                try:
                    for call in table.calls:
                        call.launch(stream)
                    event = driver.event()
                    event.record(stream)
                except BaseException:
                    driver.synchronize_stream(stream)
                    raise
                for link in links:
                    driver.stream_wait(link._stream.cuda_stream, event)
                    link._last = event
            self._last = event
        total = sum(sizes)
        watch = Watch(self._pace, total, started, self._pace.queued(total, started, alone), alone)
        return [self._make_write(event, n, watch, table.host) for n in sizes]


class FanPrepared:
    """A fan-out laid out (FanWriter.prepare): start() once, or drop it."""

    def __init__(self, fan: FanWriter, links: list, table: Table, sizes: list[int]) -> None:
        self._fan, self._links, self._table, self.sizes = fan, links, table, sizes

    def start(self) -> list[PendingWrite]:
        """One PendingWrite per peer, in order; PeerUnreachable if a link closed meanwhile
        (nothing launched)."""
        table, self._table = self._table, None
        if table is None:
            raise RuntimeError("a prepared fan-out starts once")
        try:
            return self._fan.start(self._links, table, self.sizes)
        finally:
            table.drop()

    def __del__(self) -> None:
        table = getattr(self, "_table", None)
        if table is not None:
            try:
                table.drop()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass
