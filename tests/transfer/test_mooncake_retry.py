"""MooncakeWrite's retries (transfer/transports/mooncake.py, "Restarted peers") against a
scripted engine: unit-level fault injection (the real engine meets the same failures in
tests/transfer/test_restarted_peers.py). A failed range is submitted again up to `retries`
times; however a write ends, the peer's budget is whole again."""

import numpy as np
import pytest

from transfer.errors import WriteFailed, WritesAbandoned
from transfer.transports.mooncake import MooncakeWrite, PeerBudget

RETRIES = 4


class ScriptedEngine:
    """Mooncake's transfer_submit_write / transfer_check_status: `outcomes[r]` says how each
    submission of range r ends (1 landed, -1 failed, 0 refused at submission)."""

    def __init__(self, outcomes: dict[int, list[int]]):
        self.outcomes = {r: list(o) for r, o in outcomes.items()}
        self.submitted: list[int] = []
        self._batches: dict[int, int] = {}

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        self.submitted.append(src)  # (src is the range's index here)
        code = self.outcomes[src].pop(0)
        if code == 0:
            return 0
        self._batches[len(self.submitted)] = code
        return len(self.submitted)

    def transfer_check_status(self, batch: int) -> int:
        return self._batches.pop(batch)


def _write(outcomes: dict[int, list[int]], limit: int = 64) -> tuple[MooncakeWrite, ScriptedEngine, PeerBudget]:
    te, budget = ScriptedEngine(outcomes), PeerBudget(limit)
    n = len(outcomes)
    ranges = np.arange(n, dtype=np.int64)
    return MooncakeWrite(te, "127.0.0.1:1", budget, ranges, ranges, np.ones(n, np.int64), retries=RETRIES), te, budget


@pytest.mark.parametrize("limit", [64, 1])
def test_a_range_that_failed_is_submitted_again_and_the_write_lands(limit):
    write, te, budget = _write({0: [-1, -1, 1], 1: [1], 2: [-1, 1]}, limit)
    write.wait(timeout=5)
    assert sorted(te.submitted) == [0, 0, 0, 1, 2, 2] and budget.inflight == 0 and write.ended


def test_a_range_failing_past_its_retries_fails_the_write():
    write, te, budget = _write({0: [-1] * (RETRIES + 1), 1: [1]})
    with pytest.raises(WriteFailed, match=f"failed {RETRIES + 1} time"):
        write.wait(timeout=5)
    assert te.submitted.count(0) == RETRIES + 1 and budget.inflight == 0 and write.ended


def test_a_refusal_when_submitted_again_fails_the_write():
    write, te, budget = _write({0: [-1, 0]})
    with pytest.raises(WriteFailed, match="was refused"):
        write.wait(timeout=5)
    assert te.submitted == [0, 0] and budget.inflight == 0


def test_a_timeout_is_not_submitted_again():
    write, te, budget = _write({0: [-2]})
    with pytest.raises(WriteFailed, match="timed out"):
        write.wait(timeout=5)
    assert te.submitted == [0] and budget.inflight == 0


def test_an_abandoned_write_submits_no_retry():
    """Abandoned (the link closed) after a range failed: nothing is submitted again."""
    write, te, budget = _write({0: [-1, 1]})
    write.abandon()
    write.pump()
    assert te.submitted == [0] and write.ended and budget.inflight == 0
    with pytest.raises(WritesAbandoned):
        write.poll()
