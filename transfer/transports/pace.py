"""When a write on one in-order GPU stream should be done, and how to wait for it: sleep
through most of it, watch its tail.

    a blocking-sync event wakes its waiter 0.05-0.2 ms after the GPU finished (one H100,
    docs/bench_transfer_gpu.json "wait_probe"): most of a 2k-token send's fixed cost, and
    the gap between 0.82 and 0.85 of the NVLink ceiling at 32k. Spinning on cuEventQuery
    sees the end within microseconds but holds a core for the whole write. So:

      started ...... sleep ............. | watch: query ... | done
                                         ^ expected end - (TAIL_S + TAIL_SHARE x its duration)

    duration     = START_S + bytes / rate       (START_S: the launch reaching the GPU)
    expected end = max(started, when the stream's earlier writes should end) + duration
    rate         = learned from writes that ran alone on the stream (it was idle when they
                   started): seen ending while watched, their time is a sample; found done
                   after the sleep, they ran at least that fast; starts at the link's
                   nominal rate. It rises quickly and falls slowly: a rate too high only
                   makes the watch longer, one too low sleeps past the end (a GPU busy with
                   compute gives samples that vary by 2-3x: one H100, "wait_probe")
The watch covers time.sleep's overshoot and a rate off by up to TAIL_SHARE; one that runs
SPIN_S past the expected end (the GPU slower or busier than learned) blocks on the event.
The sleep is cut into SLICE_S slices with a query after each, so a rate learned too low
costs at most one slice (and the end found teaches a rate within a slice of the truth).
"""

import threading
import time
from typing import Protocol


class Pace:
    """One stream's clock: the bytes queued on it and the rate its writes land at."""

    START_S = 20e-6  # a launch reaches the GPU (cuLaunchKernel itself: ~12 us on an H100 host)
    MIN_SAMPLE = 32 << 20  # smaller writes teach no rate (their time is mostly START_S)
    WEIGHT_UP, WEIGHT_DOWN = 0.5, 0.1  # of a new sample faster / slower than the learned rate

    def __init__(self, gbps: float):
        self.rate = gbps * 1e9  # bytes per second
        self._busy_until = 0.0  # perf_counter time the stream's queued writes should end
        self._lock = threading.Lock()

    def queued(self, nbytes: int, now: float, idle: bool) -> tuple[float, float]:
        """A write of `nbytes` queued at `now` (`idle`: nothing of the stream's still ran):
        (its expected end, its own expected duration)."""
        with self._lock:
            duration = self.START_S + nbytes / self.rate
            begin = now if idle else max(now, self._busy_until)
            self._busy_until = end = begin + duration
        return end, duration

    def learn(self, nbytes: int, seconds: float) -> None:
        """A write that ran alone took `seconds` from its launch to the end seen."""
        if nbytes >= self.MIN_SAMPLE and seconds > self.START_S:
            sample = nbytes / (seconds - self.START_S)
            with self._lock:
                self.rate += (self.WEIGHT_UP if sample > self.rate else self.WEIGHT_DOWN) * (sample - self.rate)

    def at_least(self, nbytes: int, seconds: float) -> None:
        """A write that ran alone was done within `seconds` of its launch."""
        if nbytes >= self.MIN_SAMPLE and seconds > 0:
            with self._lock:
                self.rate = max(self.rate, nbytes / seconds)


class Event(Protocol):  # what a Watch needs of a CUDA event (cuda_driver.Event)
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Watch:
    """Wait for one write: sleep until its tail, then query (module docstring)."""

    TAIL_S = 300e-6  # time.sleep's overshoot (timer slack, scheduling)
    TAIL_SHARE = 0.1  # of the write's expected duration: the learned rate's error
    SPIN_S = 2e-3  # past the expected end by this much: stop querying, block on the event
    SLICE_S = 0.5e-3  # the sleep is cut into slices, a query after each: a rate learned too low
    # (a GPU that was busy) oversleeps the end by at most one slice

    def __init__(self, pace: Pace, nbytes: int, started: float, expected: tuple[float, float], alone: bool):
        self.pace, self.nbytes, self.started = pace, nbytes, started
        self.expected_end, duration = expected
        self.wake = self.expected_end - self.TAIL_S - self.TAIL_SHARE * duration
        self.alone = alone  # the stream was idle when it started: its time is its own

    def wait(self, event: Event) -> None:
        while True:
            if event.query():  # done before we looked (asleep, or the waiter came late): when
                if self.alone:  # is unknown, only that it was by now
                    self.pace.at_least(self.nbytes, time.perf_counter() - self.started)
                return
            left = self.wake - time.perf_counter()
            if left <= 0:
                break
            time.sleep(min(left, self.SLICE_S))
        give_up = max(time.perf_counter(), self.expected_end) + self.SPIN_S
        while not event.query():  # (each query releases the GIL)
            if time.perf_counter() > give_up:
                event.synchronize()
                break
        if self.alone:
            self.pace.learn(self.nbytes, time.perf_counter() - self.started)
