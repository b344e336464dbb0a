#!/usr/bin/env python3
"""cProfile of scripts/bench_tp.py's senders, run one after another on this thread (the bench
runs them on threads, which cProfile does not follow): where a send's host time goes.

    python3 scripts/device/profile_tp.py [bench_tp flags...] [--top 30] [--warm-sends N]

Only the sends are profiled, after the first N (the warm-up round: N = the row's senders).
"""

import cProfile
import pstats
import runpy
import sys
import threading
import types
from pathlib import Path


PROFILE = cProfile.Profile()
SKIP = {"sends": 0}  # the warm-up round's sends (kernel compile, first pinning) are left out


class Inline(threading.Thread):
    """A thread that runs at start(), on the caller's thread; profiled after the warm-up."""

    def start(self) -> None:
        if SKIP["sends"] > 0:
            SKIP["sends"] -= 1
            self.run()
            return
        PROFILE.enable()
        try:
            self.run()
        finally:
            PROFILE.disable()

    def join(self, timeout=None) -> None:
        pass


def main() -> int:
    args = sys.argv[1:]
    top, warm = 30, 0
    if "--warm-sends" in args:
        i = args.index("--warm-sends")
        warm = int(args[i + 1])
        del args[i : i + 2]
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    if "--senders" not in args:
        args += ["--senders", "thread"]  # the sends in this process, where the profiler sees them
    sys.argv = ["bench_tp.py", *args]
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench_tp.py"), run_name="bench_tp")
    bench["main"].__globals__["threading"] = types.SimpleNamespace(Thread=Inline)  # the bench's name only
    SKIP["sends"] = warm
    rc = bench["main"]()
    stats = pstats.Stats(PROFILE, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return rc


if __name__ == "__main__":
    sys.exit(main())
