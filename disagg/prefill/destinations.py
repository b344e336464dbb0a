"""Where a prefill request's KV goes: one Destination per decode rank that holds some of this
prefill rank's heads, and the request's report merged over them.

    TP 1 -> 2:  prefill rank 0 --half the heads--> decode rank 0
                               --the other half--> decode rank 1      (two destinations)
    TP 2 -> 1:  prefill rank r --its heads--> decode rank 0           (one destination each)

A destination's worker sends and reports on its own; the request is sent when all are.
"""

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpool import IndexSet


@dataclass(eq=False)
class Destination:
    """One decode rank a request's KV goes to (its fields change under the table's lock,
    `report` once by its worker)."""
    peer: bytes                 # its control identity
    rank: int                   # its TP rank
    dst: IndexSet               # its destination indices
    slots: list[int]            # its staging slots lent to this transfer
    writing: bool = False       # a transfer worker sends to it now
    told: bool = False          # it heard the end (TransferDone)
    prepared: Future | None = None   # its send laid out while the KV computes (KVSender.prepare
                                     # on its peer's workers); its transfer worker takes it
    report: dict = field(default_factory=dict)   # what its send did

    def take_prepared(self):
        """Its send as prepared while the KV computed (a KVSender PreparedSend), or None (none
        was asked for, or the job failed: the send plans again and raises what planning
        raises). The job was queued on the peer's FIFO worker shard before the caller's, so a
        worker has taken it by now: waiting for it cannot deadlock, and it is not cancelled
        (a job taken but not yet marked running could still be)."""
        job, self.prepared = self.prepared, None
        if job is None:
            return None
        try:
            return job.result()
        except Exception:   # noqa: BLE001
            return None


def merged_report(dests: list[Destination]) -> dict:
    """One request's transfer report over its destinations: bytes and ranges add up, times are
    the slowest destination's (they send at once), the first write the earliest."""
    reports = [d.report for d in dests if d.report]
    if len(reports) <= 1:
        return dict(reports[0]) if reports else {}
    first = [r["first_write_at"] for r in reports if r.get("first_write_at")]
    return {**reports[0], "bytes": sum(r["bytes"] for r in reports), "ranges": sum(r["ranges"] for r in reports),
            "mode": "+".join(sorted({r["mode"] for r in reports})),
            "transfer_ms": max(r["transfer_ms"] for r in reports),
            "transfer_cpu_ms": sum(r["transfer_cpu_ms"] for r in reports),
            "after_compute_ms": max(r["after_compute_ms"] for r in reports),
            "streamed": any(r["streamed"] for r in reports),
            "prepared_ahead": all(r.get("prepared_ahead") for r in reports),
            "prepare_ms": max(r.get("prepare_ms", 0.0) for r in reports),
            "first_write_at": min(first) if first else None, "destinations": len(reports),
            "transfer_end_at": max(r["transfer_end_at"] for r in reports)}   # issue 40: the last send's end
