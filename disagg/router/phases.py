"""The hand-off phases of one request, from the two instances' merged answers (answers.merge_ranks:
each clock the latest of its instance's ranks; the send's end the latest of its reports). Differences of wall clocks, each read where
the event happened:

    prefill_done_at   the last prefill rank that sends KV finished computing   (prefill's clock)
    transfer_end_at   the last send of any prefill rank ended                  (prefill's clock)
    kv_ready_at       the last decode rank had every sender's TransferDone(ok) (decode's clock)

    kv_ready_after_compute = kv_ready_at - prefill_done_at   (what streaming hides)
    control                = kv_ready_at - transfer_end_at   (TransferDone's trip, decode's loop)

Issue 40: control was kv_ready_after_compute minus the slowest rank's send *duration*
(transfer_ms). Ranks finish computing at different times; at TP 8 -> 1 the slowest sender had
started sending up to ~2 s before the last rank's compute ended, so part of its duration lay
before prefill_done_at and control came out at -1,723 ms. The end of the last send is one
instant, whichever rank it is, so the difference above cannot go below zero on one host.
Across hosts the two clocks differ by their sync error: a phase is never reported below 0
(the last guard, not the fix).
"""


def handoff_ms(
    prefill_done_at: float | None, transfer_end_at: float | None, kv_ready_at: float | None
) -> tuple[float | None, float | None]:
    """(kv_ready_after_compute, control) in ms, or None where a clock is missing (0: unset)."""
    return _since(prefill_done_at, kv_ready_at), _since(transfer_end_at, kv_ready_at)


def _since(start: float | None, end: float | None) -> float | None:
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)) or not start or not end:
        return None
    return max(0.0, (end - start) * 1e3)
