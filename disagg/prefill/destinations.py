"""Where a prefill request's KV goes: one Destination per decode rank that holds some of this
prefill rank's heads, and the request's report merged over them.

    TP 1 -> 2:  prefill rank 0 --half the heads--> decode rank 0
                               --the other half--> decode rank 1      (two destinations)
    TP 2 -> 1:  prefill rank r --its heads--> decode rank 0           (one destination each)

A destination's worker sends and reports on its own; the request is sent when all are.
"""

from concurrent.futures import Future
from dataclasses import dataclass

from kvpool import IndexSet
from transfer.report import TransferReport, merged


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
    report: TransferReport | None = None   # what its send did (None: it has not finished)

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
    """One request's transfer report over its destinations (TransferReport.merge: they send at
    once), as the answer carries it; {} when none has sent."""
    report = merged(d.report for d in dests)
    return {**report.to_dict(), "destinations": report.sends} if report is not None else {}
