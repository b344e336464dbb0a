"""ScatterPool on its own (real worker threads): outcomes come back to the draining thread,
a stream's acks only ever cover chunks that are all scattered (a sender's acks are
cumulative: transfer.leases.AckLedger), a failed or skipped chunk ends its stream's acks from
that chunk on (the chunks below it are still acknowledged as they finish), and
the owner's wake is called for every outcome."""

import threading

import pytest

from transfer.errors import StagingError
from transfer.scatters import Scattered, ScatterPool


class Loop:
    """The owner's side: a wake counter (a condition) and drain until enough outcomes came."""

    def __init__(self, workers: int = 4):
        self.cond, self.wakes = threading.Condition(), 0
        self.pool = ScatterPool(workers, self.wake)
        self.outcomes: list = []

    def wake(self) -> None:
        with self.cond:
            self.wakes += 1
            self.cond.notify_all()

    def until(self, n: int) -> list:
        """Drain until n outcomes came in all (as the loop does after each wake)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.wakes >= n, timeout=10), f"{self.wakes} of {n} outcomes"
        self.outcomes += self.pool.drain()
        return [(o.stream, o.index, o.state, o.ack_upto) for o in self.outcomes]


def gated():
    """A copy that runs once its event is set, and the event."""
    go = threading.Event()
    return go, lambda: go.wait(10) or pytest.fail("gate never opened")


def test_a_later_chunk_scattered_first_is_acknowledged_only_with_the_earlier_one():
    loop = Loop()
    gates = [gated() for _ in range(3)]
    for i, (_, copy) in enumerate(gates):
        loop.pool.submit("a", i, lambda: True, copy)
    gates[2][0].set()
    assert loop.until(1) == [("a", 2, Scattered.SCATTERED, None)]  # 0 and 1 still copying
    gates[0][0].set()
    assert loop.until(2)[-1] == ("a", 0, Scattered.SCATTERED, 0)  # 0 alone: 1 still copying
    gates[1][0].set()
    assert loop.until(3)[-1] == ("a", 1, Scattered.SCATTERED, 2)  # 1 and the held 2
    assert loop.pool.busy() == 0
    loop.pool.submit("a", 3, lambda: True, lambda: None)  # a later chunk of the stream: acked alone
    assert loop.until(4)[-1] == ("a", 3, Scattered.SCATTERED, 3)
    loop.pool.close()


def test_streams_are_acknowledged_independently_and_a_failure_ends_only_its_own():
    loop = Loop()
    go, copy = gated()

    def bad():
        go.wait(10)
        raise StagingError("chunk 0: slot 9 outside [0, 4)")

    loop.pool.submit("a", 0, lambda: True, bad, tag="room a")
    loop.pool.submit("a", 1, lambda: True, lambda: None)
    loop.pool.submit("b", 0, lambda: True, lambda: None)
    got = loop.until(2)
    assert ("a", 1, Scattered.SCATTERED, None) in got and ("b", 0, Scattered.SCATTERED, 0) in got
    go.set()
    loop.until(3)
    [failed] = [o for o in loop.outcomes if o.state is Scattered.FAILED]
    assert failed.index == 0 and failed.tag == "room a" and isinstance(failed.error, StagingError)
    assert failed.ack_upto is None and loop.pool.busy() == 0  # chunk 1 of "a" is never acknowledged
    loop.pool.close()


def test_chunks_below_a_failed_one_are_still_acknowledged_when_they_finish_after_it():
    """Chunk 1 is refused while chunk 0 still copies: chunk 0's ack still comes (an ack of 0
    says only that 0 is scattered, which it is), chunk 2's never does. The full suite once saw
    the sender's AckTimeout read "no ack heard" here, hiding that the acks stopped at chunk 1."""
    loop = Loop()
    go, copy = gated()

    def refused():
        raise StagingError("chunk 1: items [64, 128) outside 100 full destination indices")

    loop.pool.submit("a", 0, lambda: True, copy)
    loop.pool.submit("a", 1, lambda: True, refused)
    loop.pool.submit("a", 2, lambda: True, lambda: None)
    got = loop.until(2)
    assert ("a", 1, Scattered.FAILED, None) in got and ("a", 2, Scattered.SCATTERED, None) in got
    go.set()
    assert loop.until(3)[-1] == ("a", 0, Scattered.SCATTERED, 0)
    assert loop.pool.busy() == 0
    loop.pool.close()


def test_a_chunk_whose_request_ended_while_it_waited_is_skipped_never_copied():
    """One worker busy; the request ends while the next chunk waits: its worker asks live()
    when it starts, and does not copy."""
    loop = Loop(workers=1)
    go, copy = gated()
    inside, alive, copied = threading.Event(), [True], []
    loop.pool.submit("a", 0, lambda: alive[0], lambda: (inside.set(), copy()))
    loop.pool.submit("a", 1, lambda: alive[0], lambda: copied.append(1))
    assert inside.wait(10)
    alive[0] = False  # (the owner's table says so under its lock; chunk 0 is already copying)
    go.set()
    got = loop.until(2)
    assert got == [("a", 0, Scattered.SCATTERED, 0), ("a", 1, Scattered.SKIPPED, None)] and not copied
    loop.pool.close()


def test_no_workers_is_refused():
    with pytest.raises(ValueError, match="scatter workers must be >= 1"):
        ScatterPool(0, lambda: None)
