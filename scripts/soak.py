#!/usr/bin/env python3
"""Soak: a prefill/decode pair under mixed load with random kills, for a given duration.

Load threads keep posting requests of random length through the router; every few seconds
one side (alternating) is killed with SIGKILL mid-flight. The load then pauses until what was
in flight has ended, the survivor's pool must be back at its initial free counts (a leak
otherwise), the victim restarts with a new router, and the load resumes; at the end both
pools must be back. Every successful request is verified on decode, so
a corrupted byte shows up as ok-but-unverified, counted separately. Optionally a share of the
requests is cancelled by its client (router POST /abort) and failures are injected. With
--hostile, attackers run beside the load all along: slow clients trickling header bytes to the
router (slowloris), idle connections held open at its connection bound, and a decode frozen
(SIGSTOP) for a few seconds between kills; real requests must keep being served.

    .venv/bin/python scripts/soak.py --duration 600 [--cancel-rate 0.05] [--hostile]
        [--inject-faults send.write=0.01,decode.alloc=0.01] [--json]
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.request

from disagg.api import metrics
from disagg.tools.launcher import Launcher
from disagg.router.router import post_json

COMMON = [
    "--device",
    "cpu",
    "--max-requests",
    "32",
    "--bootstrap-timeout",
    "15",
    "--waiting-timeout",
    "15",
    "--transfer-timeout",
    "15",
    "--dead-after",
    "2",
]


def pool_free(http: str) -> dict:
    with urllib.request.urlopen(http + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return metrics.pool_free(text)


def router_ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(http + "/ready", timeout=10) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _connect(url: str) -> socket.socket | None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=5)
    except OSError:
        return None


def slowloris(state: dict, stop: threading.Event, stats: dict, lock: threading.Lock) -> None:
    """One slow client: a request line, then a header byte every 0.5 s, reconnecting whenever
    the router cuts it off (what the receipt deadline and eviction must do)."""
    while not stop.is_set():
        sock = _connect(state["router"])
        if sock is None:
            stop.wait(0.5)
            continue
        try:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            while not stop.wait(0.5):
                sock.sendall(b"a")
        except OSError:
            with lock:
                stats["hostile"]["slow_cut_off"] += 1
        finally:
            sock.close()


def idler(state: dict, stop: threading.Event, stats: dict, lock: threading.Lock, n: int) -> None:
    """`n` connections that send nothing, reopened as the router closes them."""
    held: list[socket.socket] = []
    while not stop.wait(0.5):
        alive = []
        for sock in held:
            sock.setblocking(False)
            try:
                gone = sock.recv(1 << 16) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            (sock.close() if gone else alive.append(sock))
            if gone:
                with lock:
                    stats["hostile"]["idle_closed"] += 1
        held = alive
        while len(held) < n and not stop.is_set():
            sock = _connect(state["router"])
            if sock is None:
                break
            held.append(sock)
    for sock in held:
        sock.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--preset", default="tiny-hybrid")
    ap.add_argument("--max-tokens", default="65536")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--kill-every", default="8:20", help="MIN:MAX seconds between kills")
    ap.add_argument("--prompt-len", default="16:3000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cancel-rate", type=float, default=0.0, help="share of requests the client aborts")
    ap.add_argument("--inject-faults", default="", help="POINT=RATE,... for both workers (transfer/faults.py)")
    ap.add_argument(
        "--hostile",
        action="store_true",
        help="slow clients, idle connections at the router's bound and a frozen decode beside the load",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kmin, kmax = (float(x) for x in args.kill_every.split(":"))
    pmin, pmax = (int(x) for x in args.prompt_len.split(":"))
    common = ["--preset", args.preset, "--max-tokens", args.max_tokens, *COMMON]
    if args.inject_faults:
        common += ["--inject-faults", args.inject_faults, "--fault-seed", str(args.seed)]
    stats = {
        "requests": 0,
        "ok": 0,
        "failed": 0,
        "cancelled": 0,
        "corrupted": 0,
        "kills": {"prefill": 0, "decode": 0},
        "leaks": [],
        "failures": {},
        "hostile": {"slow_cut_off": 0, "idle_closed": 0, "freezes": 0, "ok_while_frozen_or_after": 0},
    }
    lock = threading.Lock()
    state: dict = {}
    stop = threading.Event()
    running = threading.Event()  # cleared while a kill is being checked: the load pauses
    running.set()
    inflight = [0]

    def load(worker: int) -> None:
        local = random.Random(args.seed * 1000 + worker)
        while not stop.is_set():
            running.wait()
            n = local.randint(pmin, pmax)
            with lock:
                inflight[0] += 1
            body = {"prompt_len": n, "seed": local.randrange(1 << 30)}
            cancel = None
            if local.random() < args.cancel_rate:  # the client gives up after 0-300 ms
                body["request_id"] = f"soak-{worker}-{local.randrange(1 << 40)}"
                cancel = threading.Timer(
                    local.uniform(0, 0.3),
                    post_json,
                    (state["router"] + "/abort", {"request_id": body["request_id"]}, 10),
                )
                cancel.start()
            r = post_json(state["router"] + "/generate", body, 60)
            if cancel is not None:
                cancel.cancel()
            with lock:
                inflight[0] -= 1
                stats["requests"] += 1
                if r.get("ok") and r.get("verified"):
                    stats["ok"] += 1
                elif r.get("ok"):
                    stats["corrupted"] += 1
                elif r.get("reason") == "cancelled by the client":
                    stats["cancelled"] += 1
                else:
                    stats["failed"] += 1
                    key = re.sub(r"\d+", "N", str(r.get("reason", "?")))[:90]
                    stats["failures"][key] = stats["failures"].get(key, 0) + 1

    with Launcher() as launcher:
        procs: dict = {}

        def start(role: str) -> dict:
            if role == "prefill":  # a restart binds the bootstrap address decode was configured with
                bind = state["prefill"]["bootstrap"] if "prefill" in state else "tcp://127.0.0.1:*"
                ready = launcher.start("prefill", *common, "--bootstrap-bind", bind)
            else:
                ready = launcher.start(
                    "decode", *common, "--quarantine", "3", "--bootstrap-addr", state["prefill"]["bootstrap"]
                )
            procs[role] = launcher.procs[-1]
            return ready

        def new_router() -> None:  # ready once decode has registered with the (restarted) prefill
            p, d = state["prefill"], state["decode"]
            state["router"] = launcher.start("router", "--pair", f"{p['http']},{d['http']},{p['bootstrap']}")["http"]
            wait_for(lambda: router_ready(state["router"]), 30)

        state["prefill"] = start("prefill")
        state["decode"] = start("decode")
        new_router()
        initial = {role: pool_free(state[role]["http"]) for role in ("prefill", "decode")}
        with urllib.request.urlopen(state["decode"]["http"] + "/health", timeout=10) as resp:
            stats["auth"] = json.loads(resp.read())["auth"]  # curve: the launcher gave the pair a key
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(args.concurrency)]
        if args.hostile:  # the router's bound is --max-inflight (256) + 32: fill it with idlers and tricklers
            threads += [
                threading.Thread(target=slowloris, args=(state, stop, stats, lock), daemon=True) for _ in range(64)
            ]
            threads.append(threading.Thread(target=idler, args=(state, stop, stats, lock, 240), daemon=True))
        for t in threads:
            t.start()
        end = time.monotonic() + args.duration
        victim = "decode"
        while time.monotonic() < end:
            time.sleep(min(rng.uniform(kmin, kmax), max(0.0, end - time.monotonic())))  # load runs meanwhile
            if time.monotonic() >= end:
                break
            if args.hostile and victim == "decode":  # a frozen decode first: its requests fail, it thaws, it serves
                ok_before = stats["ok"]
                os.kill(procs["decode"].pid, signal.SIGSTOP)
                time.sleep(3)
                os.kill(procs["decode"].pid, signal.SIGCONT)
                stats["hostile"]["freezes"] += 1
                wait_for(lambda: stats["ok"] > ok_before, 60)
                stats["hostile"]["ok_while_frozen_or_after"] += stats["ok"] - ok_before
            survivor = "prefill" if victim == "decode" else "decode"
            os.kill(procs[victim].pid, signal.SIGKILL)
            stats["kills"][victim] += 1
            # pause the load, let what is in flight end (fail or finish), then the survivor must
            # have given back every slot the killed peer's requests held
            running.clear()
            wait_for(lambda: inflight[0] == 0, 120)
            if not wait_for(lambda: pool_free(state[survivor]["http"]) == initial[survivor], 30):
                stats["leaks"].append(
                    {
                        "after_killing": victim,
                        "survivor": survivor,
                        "free": pool_free(state[survivor]["http"]),
                        "initial": initial[survivor],
                    }
                )
            state[victim] = start(victim)
            initial[victim] = pool_free(state[victim]["http"])
            new_router()
            running.set()
            victim = survivor
        stop.set()
        for t in threads:
            t.join(90)
        for role in ("prefill", "decode"):
            if not wait_for(lambda: pool_free(state[role]["http"]) == initial[role], 30):
                stats["leaks"].append(
                    {"at_end": role, "free": pool_free(state[role]["http"]), "initial": initial[role]}
                )
    stats["duration_s"] = args.duration
    if args.json:
        print(json.dumps(stats))
    else:
        print(json.dumps(stats, indent=2))
    served = stats["ok"] > 0 and (
        not args.hostile or stats["hostile"]["ok_while_frozen_or_after"] > 0 or stats["hostile"]["freezes"] == 0
    )
    return 0 if not stats["leaks"] and stats["corrupted"] == 0 and served else 1


if __name__ == "__main__":
    sys.exit(main())
