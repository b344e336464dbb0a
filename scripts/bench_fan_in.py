#!/usr/bin/env python3
"""Mooncake TCP alone, N writers into one receiver: what issue 40's N -> 1 costs below our code.

N sender processes (a MooncakeTransport of one engine each, on lane = their rank) write
--mib MiB in all, split evenly, into one receiver process's buffer (a transport of
--engines engines), in ranges of --range-kib; every sender starts each round at once (a
barrier). Printed per N: the round's wall time (median, min) and the receiver process's CPU
time per round (mean; clock ticks of /proc), beside N = 1 in the same run.

    .venv/bin/python scripts/bench_fan_in.py [--senders 1,8] [--engines 4] [--rounds 40]
                                             [--mib 60] [--range-kib 7680] [--json]
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from transfer.transports.base import Offer  # noqa: E402
from transfer.transports.mooncake import MooncakeTransport  # noqa: E402
from transfer.transports.ranges import Ranges  # noqa: E402


def _cpu_ms(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def _receiver(nbytes: int, engines: int, offers, stop) -> None:
    buf = np.zeros(nbytes, dtype=np.uint8)
    transport = MooncakeTransport(engines=engines)
    exposure = transport.expose([(buf.ctypes.data, nbytes)])
    offers.put(msgspec.msgpack.encode(exposure.offer()))
    stop.wait()


def _sender(rank: int, share: int, range_bytes: int, offer: bytes, barrier, done, rounds: int) -> None:
    src = np.full(share, rank + 1, dtype=np.uint8)
    transport = MooncakeTransport(engines=1)
    exposure = transport.expose([(src.ctypes.data, share)])
    link = transport.connect(msgspec.msgpack.decode(offer, type=Offer), exposure, lane=rank)
    link.write(Ranges.one(0, 0, 0, rank * share, 4096), timeout=30)  # the session, before any round
    at = np.arange(share // range_bytes, dtype=np.int64) * range_bytes
    zero = np.zeros_like(at)
    ranges = Ranges(zero, at, zero, rank * share + at, np.full_like(at, range_bytes))
    for _ in range(rounds):
        barrier.wait()
        link.write(ranges, timeout=60)
        done.put(rank)
        barrier.wait()


def measure(n: int, args) -> dict:
    ctx = mp.get_context("spawn")
    nbytes = args.mib << 20
    offers, stop, done, barrier = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Barrier(n + 1)
    receiver = ctx.Process(target=_receiver, args=(nbytes, args.engines, offers, stop))
    receiver.start()
    offer = offers.get(timeout=120)
    share = nbytes // n
    range_bytes = min(args.range_kib << 10, share)
    senders = [
        ctx.Process(target=_sender, args=(r, share, range_bytes, offer, barrier, done, args.rounds)) for r in range(n)
    ]
    for s in senders:
        s.start()
    walls, cpus = [], []
    for _ in range(args.rounds):
        c0, t0 = _cpu_ms(receiver.pid), time.perf_counter()
        barrier.wait()
        for _ in range(n):
            done.get(timeout=120)
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append(_cpu_ms(receiver.pid) - c0)
        barrier.wait()
    for s in senders:
        s.join()
    stop.set()
    receiver.join()
    moved = share // range_bytes * range_bytes * n
    return {
        "senders": n,
        "bytes": moved,
        "range_bytes": range_bytes,
        "wall_ms_median": round(statistics.median(walls), 2),
        "wall_ms_min": round(min(walls), 2),
        "receiver_cpu_ms_mean": round(statistics.mean(cpus), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--senders", default="1,8")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--mib", type=int, default=60)
    ap.add_argument("--range-kib", type=int, default=7680)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(int(n), args) for n in args.senders.split(",")]
    base = rows[0]["wall_ms_median"]
    for row in rows:
        row["x_first"] = round(row["wall_ms_median"] / base, 2)
    if args.json:
        print(json.dumps({"engines": args.engines, "host_cores": os.cpu_count(), "rows": rows}, indent=1))
        return
    for row in rows:
        print(
            f"{row['senders']} -> 1: {row['bytes'] / 1e6:.1f} MB in ranges of {row['range_bytes'] >> 10} KiB, "
            f"wall {row['wall_ms_median']} ms (min {row['wall_ms_min']}, x{row['x_first']}), "
            f"receiver CPU {row['receiver_cpu_ms_mean']} ms"
        )


if __name__ == "__main__":
    main()
