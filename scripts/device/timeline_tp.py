#!/usr/bin/env python3
"""Where a bench_tp row's time goes, per repeat, from timestamps in every process (the bench,
each sender process, each decode peer): when the staged writes landed, when decode scattered
them, and how long after the last write landed the last ack came (issue 40).

    python3 scripts/device/timeline_tp.py --tp 8:1 --tokens 1500 --page-sizes 16 [bench_tp flags...]

Every process of the run imports a sitecustomize (written to a temporary folder put first on
PYTHONPATH) that wraps a few methods with timestamps: gather, the transport write and its wait,
the chunk notice, the decode-side submit and scatter, the ack; each process writes its events
at exit. One run: the rows of --tp in order; a round is one send of every sender of a row.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOKS = """
import atexit, json, os, sys, threading, time
_ev = []
def _dump():
    with open(os.path.join(os.environ["TP_TIMELINE"], f"{os.getpid()}.jsonl"), "w") as f:
        for e in _ev:
            f.write(json.dumps(e) + "\\n")
def _wrap(cls, name, tag, after=True):
    orig = getattr(cls, name)
    def timed(*a, **k):
        _ev.append((time.time(), os.getpid(), tag + ">"))
        try:
            return orig(*a, **k)
        finally:
            after and _ev.append((time.time(), os.getpid(), tag + "<"))
    setattr(cls, name, timed)
if os.environ.get("TP_TIMELINE"):
    atexit.register(_dump)
    import transfer.gather as g, transfer.sender as s, transfer.scatters as sc, transfer.receiver as r
    import transfer.transports.mooncake as mc, harness.pair_channel as pc
    _wrap(s.KVSender, "send", "send"); _wrap(g.Gatherer, "gather", "gather")
    _wrap(mc.MooncakeLink, "write_async", "write", after=False); _wrap(mc.MooncakeWrite, "wait", "landed")
    _wrap(pc.PairChannel, "notify", "notify", after=False); _wrap(sc.ScatterPool, "submit", "submit", after=False)
    _wrap(r.KVReceiver, "on_chunk", "scatter"); _wrap(pc.PairChannel, "send_done", "ack", after=False)
"""


def summary(events: list, senders: int) -> list[str]:
    """A line per round of `senders` sends: its span, chunks, when writes landed, the scatters'
    span and busy time, and the tail from the last landed write to the last send's end."""
    events.sort()
    starts = [e[0] for e in events if e[2] == "send>"]
    out = []
    for r in range(len(starts) // senders):
        t0 = starts[r * senders]
        t1 = starts[(r + 1) * senders] if (r + 1) * senders < len(starts) else float("inf")
        at = lambda tag: [e[0] for e in events if e[2] == tag and t0 - 1e-3 <= e[0] < t1 - 1e-3]  # noqa: E731
        ms = lambda t: (t - t0) * 1e3  # noqa: E731
        end, landed, sc, sce = max(at("send<")), at("landed<"), at("scatter>"), at("scatter<")
        busy = sum(b - a for a, b in zip(sorted(sc), sorted(sce))) * 1e3
        out.append(
            f"round {r}: {ms(end):7.1f} ms; chunks {len(at('submit>'))}; writes landed {ms(min(landed)):6.1f}.."
            f"{ms(max(landed)):6.1f}; scatters {ms(min(sc)):6.1f}..{ms(max(sce)):6.1f} (busy {busy:6.1f} ms); "
            f"last ack {(end - max(landed)) * 1e3:6.1f} ms after the last write landed"
        )
    return out


def main() -> int:
    args = sys.argv[1:]
    if "--tp" not in args:
        args += ["--tp", "8:1"]
    if "," in args[args.index("--tp") + 1]:
        raise SystemExit("one row per run (--tp N:M): a round is one send of every sender of the row")
    repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 3
    with tempfile.TemporaryDirectory() as hooks, tempfile.TemporaryDirectory() as out:
        Path(hooks, "sitecustomize.py").write_text(HOOKS)
        paths = [hooks, str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "TP_TIMELINE": out, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        rc = subprocess.call([sys.executable, str(ROOT / "scripts" / "bench_tp.py"), *args], env=env)
        events = [tuple(json.loads(line)) for f in glob.glob(f"{out}/*.jsonl") for line in open(f)]
    sends = sum(1 for e in events if e[2] == "send>")
    print("\n".join(summary(events, sends // (repeats + 1))))  # (the first round: bench_tp's warm-up)
    return rc


if __name__ == "__main__":
    sys.exit(main())
