#!/usr/bin/env python3
"""Decode's KV arrival at the worker level, hop by hop: a producer and a consumer DisaggWorker
in two processes (tests/vllm_connector/worker_child.py: vLLM's config and CPU layout of the
tiny Llama, the real bootstrap, CURVE, cma or Mooncake TCP), each pinned to a core of its own
as bench_vllm pins its servers. Per request the producer holds N blocks and the consumer loads
them; finished() is asked as vLLM's worker asks it, once a step: spinning between the calls
(--poll 0) and holding the GIL for --step-ms of each (a step's own Python work); --hogs puts
busy processes beside each side (a server's other processes on its core). Runs in the vLLM
venv; no api_server is started.

    request_ms   the consumer's step (its load handed to the worker) -> finished() reports it
    hops         disagg.vllm.hops marks (DISAGG_HOPS=1), the median ms from one to the next:
                 c.step -> c.taken (the consumer's loop took the step) -> c.lookup / c.introduced
                 (a lookup thread found the producer ranks, registered) -> c.asked (the loop sent
                 the TransferRequest) -> p.asked (the producer's loop got it) -> p.sending (a
                 transfer thread took it) -> p.written (the writes landed) -> p.told (its
                 TransferDone queued) -> c.done (the consumer's loop got it) -> c.finished

    .venv-vllm/bin/python scripts/bench_worker_arrival.py --blocks 4,16,30 --repeat 40 [--step-ms 1 --hogs 1]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm_connector"))
os.environ["DISAGG_HOPS"] = "1"  # the children's recorders

import tiny_models  # noqa: E402
from test_worker import Child, Worker, _free_port  # noqa: E402

from disagg.control.auth import AuthKey  # noqa: E402

ORDER = ("c.step", "c.taken", "c.lookup", "c.introduced", "c.asked", "p.asked", "p.sending", "p.written")
ORDER += ("p.told", "c.done", "c.finished")


def _start(model: Path, logs: Path, num_blocks: int, cma: bool) -> tuple[Worker, Worker, str]:
    boot = f"tcp://127.0.0.1:{_free_port()}"
    prod = {"role": "kv_producer", "layout": "cpu", "seed": 1, "extra": {"bootstrap": boot, "cma": cma}}
    cons = {"role": "kv_consumer", "layout": "cpu", "seed": 2, "extra": {"cma": cma}}
    p = Child("producer", model, {"w": prod}, logs, num_blocks)
    c = Child("consumer", model, {"w": cons}, logs, num_blocks)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(p.proc.pid, {cores[0]})  # (before they start their threads: importing vLLM takes seconds)
    os.sched_setaffinity(c.proc.pid, {cores[-1]})
    p.ready(), c.ready()
    return Worker(p, "w"), Worker(c, "w"), boot


def _hogs(n: int) -> list[subprocess.Popen]:
    """`n` busy processes on each core the two sides run on: the load a vLLM server's other
    processes (its API server, engine core, spinning threads) put beside its worker."""
    cores = sorted(os.sched_getaffinity(0))
    hogs = []
    for core in (cores[0], cores[-1]) if n else ():
        for _ in range(n):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(hogs[-1].pid, {core})
    return hogs


def _one(producer: Worker, consumer: Worker, boot: str, room: int, n: int, poll: float, step_s: float = 0.0) -> None:
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    tokens = n * 32
    producer.step(sends=[{"req_id": f"p{room}", "room": room, "num_tokens": tokens, "blocks": src}])
    remote = {"room": room, "bootstrap": boot, "num_tokens": tokens}
    load = {"req_id": f"c{room}", "remote": remote, "first": 0, "count": tokens, "blocks": dst}
    consumer.step(loads=[load])
    got = consumer.child.ask({"op": "wait", "worker": "w", "timeout": 10.0, "poll": poll, "step_s": step_s}, 20.0)
    assert got["recving"] == [f"c{room}"] and not got["errors"], got
    assert producer.wait(10.0)["sending"] == [f"p{room}"]


def _hops(*children: Child) -> dict[int, dict[str, int]]:
    rooms: dict[int, dict[str, int]] = defaultdict(dict)
    for child in children:
        for t, room, hop, *_ in child.ask({"op": "hops"})["hops"]:
            rooms[room].setdefault(hop, t)
    return rooms


def summary(rooms: dict[int, dict[str, int]]) -> dict:
    """Median ms between successive hops present in every room, and of the whole request."""
    seen = [h for h in ORDER if all(h in marks for marks in rooms.values())]
    hops = {
        f"{a} -> {b}": round(statistics.median((m[b] - m[a]) / 1e6 for m in rooms.values()), 3)
        for a, b in zip(seen, seen[1:])
    }
    total = [(m["c.finished"] - m["c.step"]) / 1e6 for m in rooms.values()]
    q = statistics.quantiles(total, n=10)
    return {
        "request_ms": {"median": round(statistics.median(total), 3), "p10": round(q[0], 3), "p90": round(q[-1], 3)},
        "hops": hops,
    }


def _measure(producer: Worker, consumer: Worker, boot: str, sizes: list[int], args) -> dict:
    """args.repeat requests of each size, the sizes taking turns (a load on the machine hits
    each alike), with args.hogs busy processes beside each side -> summary() per size."""
    _one(producer, consumer, boot, 1, 1, args.poll)  # registration, first use of each path
    _hops(producer.child, consumer.child)
    size_of, hogs = {}, _hogs(args.hogs)
    try:
        for i in range(args.repeat * len(sizes)):
            size_of[100 + i] = sizes[i % len(sizes)]
            _one(producer, consumer, boot, 100 + i, size_of[100 + i], args.poll, args.step_ms / 1e3)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    marks = _hops(producer.child, consumer.child)
    return {n: summary({r: m for r, m in marks.items() if size_of.get(r) == n}) for n in sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="4,16,30")
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--poll", type=float, default=0.0, help="s between finished() calls (0: spin, yielding)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="Python work (GIL held) between finished() calls")
    ap.add_argument("--hogs", type=int, default=0, help="busy processes on each of the two cores while measuring")
    ap.add_argument("--no-cma", action="store_true", help="Mooncake TCP instead of cma")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["DISAGG_AUTH_KEY"] = str(tmp / "key")
        AuthKey.generate(os.environ["DISAGG_AUTH_KEY"])
        model = tiny_models.build_tiny_llama(tmp / "model")
        producer, consumer, boot = _start(model, tmp, 2 * max(sizes) + 2, not args.no_cma)
        try:
            out = _measure(producer, consumer, boot, sizes, args)
        finally:
            consumer.child.close()
            producer.child.close()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
