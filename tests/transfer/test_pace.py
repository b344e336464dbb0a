"""The GPU link's wait (transports/pace.py): where a write on one stream should end, the rate
learned from writes that ran alone, and a wait that sleeps through the write and only
watches its tail. The event is a stand-in that lands at a set perf_counter time: this is
about when the waiter looks, not about CUDA (the gpu suite runs the real one)."""

import time

import pytest

from transfer.transports.pace import Pace, Watch


class _Event:
    """Lands at `at` (perf_counter); records when it was asked; synchronize() lands it."""

    def __init__(self, at: float):
        self.at, self.asked, self.synced, self.synced_at = at, [], 0, None

    def query(self) -> bool:
        now = time.perf_counter()
        self.asked.append(now)
        return now >= self.at

    def synchronize(self) -> None:
        self.synced += 1
        self.at = self.synced_at = time.perf_counter()


def test_a_write_queued_behind_others_is_expected_after_them():
    pace = Pace(gbps=100.0)
    start = Pace.START_S
    first, d1 = pace.queued(100_000_000, now=10.0, idle=True)  # 1 ms at 100 GB/s
    second, d2 = pace.queued(50_000_000, now=10.0002, idle=False)  # behind the first
    assert (d1, d2) == (pytest.approx(start + 0.001), pytest.approx(start + 0.0005))
    assert first == pytest.approx(10.0 + d1) and second == pytest.approx(first + d2)
    assert pace.queued(1_000, now=20.0, idle=True)[0] == pytest.approx(20.0 + start + 1e-8)  # idle: from now
    assert pace.queued(1_000, now=30.0, idle=False)[0] == pytest.approx(30.0 + start + 1e-8)  # earlier ones long done


def test_the_rate_follows_writes_that_ran_alone_launch_time_aside_and_small_ones_teach_nothing():
    pace = Pace(gbps=100.0)
    pace.learn(1 << 20, 1e-6)  # a small write: mostly launch latency
    pace.learn(16 << 20, Pace.START_S)  # still small: 16 MiB at 400 GB/s is 42 us
    assert pace.rate == 100e9
    for _ in range(40):
        pace.learn(400_000_000, Pace.START_S + 1e-3)  # 400 GB/s once the launch reached the GPU
    assert pace.rate == pytest.approx(400e9, rel=1e-3)
    pace.learn(400_000_000, Pace.START_S + 2e-3)  # one slow write (compute beside it): 200 GB/s
    slower = pace.rate
    pace.learn(400_000_000, Pace.START_S + 1e-3)  # and a fast one again
    assert 350e9 < slower < 400e9 and pace.rate > slower + (400e9 - slower) / 3  # falls slowly, rises quickly


def test_a_long_write_is_slept_through_and_only_its_tail_is_watched(monkeypatch):
    monkeypatch.setattr(Watch, "SPIN_S", 1.0)  # (a preempted CI thread must not fall back to blocking)
    pace = Pace(gbps=100.0)
    started = time.perf_counter()
    expected = pace.queued(1_000_000_000, started, idle=True)  # 10 ms
    end, duration = expected
    event = _Event(at=end)
    Watch(pace, 1_000_000_000, started, expected, alone=True).wait(event)
    assert time.perf_counter() >= end and event.synced == 0
    tail = end - Watch.TAIL_S - Watch.TAIL_SHARE * duration
    asleep = [t for t in event.asked if t < tail]  # one query per sleep slice, none in between
    assert len(asleep) <= duration / Watch.SLICE_S + 1 and len(event.asked) > len(asleep) + 1
    assert pace.rate == pytest.approx(100e9, rel=0.1)  # seen ending when expected: the rate holds


def test_a_rate_learned_too_low_oversleeps_by_one_slice_at_most_and_climbs_back():
    pace = Pace(gbps=10.0)  # learned far too low: 400 MB "takes" 40 ms
    started = time.perf_counter()
    expected = pace.queued(400_000_000, started, idle=True)
    event = _Event(at=started + 0.005)  # it took 5 ms
    Watch(pace, 400_000_000, started, expected, alone=True).wait(event)
    done = time.perf_counter()
    assert done < expected[0] - 0.02, "slept on toward the expected end"
    assert pace.rate >= 400_000_000 / (done - started) * 0.99 and pace.rate > 40e9  # at least 80 GB/s seen


def test_a_write_found_done_after_the_sleep_says_only_how_fast_it_ran_at_least():
    pace = Pace(gbps=100.0)
    started = time.perf_counter()
    Watch(pace, 400_000_000, started, (started + 0.04, 0.04), alone=True).wait(_Event(at=started))  # done at once
    elapsed = time.perf_counter() - started
    assert pace.rate >= 400_000_000 / elapsed * 0.99  # as fast as the first query shows, at least
    rate = pace.rate
    Watch(pace, 400_000_000, time.perf_counter() - 1.0, (time.perf_counter(), 0.004), alone=True).wait(_Event(at=0.0))
    assert pace.rate == rate  # "at least 0.4 GB/s" says nothing new
    event = _Event(at=time.perf_counter() + 0.002)
    Watch(pace, 100_000_000, started, (started + 0.001, 0.001), alone=False).wait(event)  # behind another write
    assert pace.rate == rate and time.perf_counter() >= event.at


def test_a_write_slower_than_learned_stops_being_watched_and_is_waited_for_blocking():
    pace = Pace(gbps=100.0)
    started = time.perf_counter()
    expected = started + 0.001
    event = _Event(at=float("inf"))  # only the blocking wait sees it land
    Watch(pace, 100_000_000, started, (expected, 0.001), alone=True).wait(event)
    assert event.synced == 1
    assert event.synced_at >= expected + Watch.SPIN_S and len(event.asked) > 1  # watched SPIN_S past it first
    assert pace.rate < 100e9  # it took longer than 1 ms: the rate comes down
