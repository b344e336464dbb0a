"""`disagg bench`: drive a router with a workload and summarize it."""

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from disagg.router import post_json

HELP = "drive a router with a workload; print throughput, GB/s and latency percentiles"
PHASES = ("total", "bootstrap", "prefill", "transfer", "wait", "verify", "decode")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8000")
    add_workload_flags(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", default="128:1024", help="N or MIN:MAX (uniform)")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)


def _lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    lo, _, hi = spec.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--prompt-len: bad range {spec!r}")
    return rng.integers(lo, hi + 1, n).tolist()


def run_workload(router: str, args: argparse.Namespace, progress=None) -> dict:
    rng = np.random.default_rng(args.seed)
    lengths = _lengths(args.prompt_len, args.requests, rng)
    results = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(post_json, router + "/generate",
                               {"prompt_len": n, "max_new_tokens": args.max_new_tokens, "seed": args.seed + i}, 120)
                   for i, n in enumerate(lengths)]
        for f in as_completed(futures):
            results.append(f.result())
            if progress:
                progress(len(results), args.requests)
    wall = time.perf_counter() - t0
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r.get("ok")]
    total_bytes = sum(r.get("bytes", 0) for r in ok)
    transfer_s = sum((r["timings_ms"].get("transfer") or 0) for r in ok) / 1e3
    latency = {}
    for phase in PHASES:
        values = [r["timings_ms"][phase] for r in ok if r.get("timings_ms", {}).get(phase) is not None]
        if values:
            q = np.percentile(values, [50, 90, 99])
            latency[phase] = {"p50": round(q[0], 2), "p90": round(q[1], 2), "p99": round(q[2], 2),
                              "mean": round(statistics.fmean(values), 2)}
    failures: dict[str, int] = {}
    for r in results:
        if not r.get("ok"):
            key = str(r.get("reason", "unknown"))[:120]
            failures[key] = failures.get(key, 0) + 1
    control = [(r["timings_ms"]["wait"] or 0) - (r["timings_ms"]["transfer"] or 0) for r in ok
               if r["timings_ms"].get("wait") is not None and r["timings_ms"].get("transfer") is not None]
    return {
        "requests": len(results), "verified": sum(1 for r in ok if r.get("verified")),
        "failed": len(results) - len(ok), "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 2) if wall else 0.0,
        "bytes": total_bytes, "gbps": round(total_bytes / wall / 1e9, 3) if wall else 0.0,
        "transfer_gbps": round(total_bytes / transfer_s / 1e9, 3) if transfer_s else 0.0,
        "modes": {m: sum(1 for r in ok if r.get("mode") == m) for m in {r.get("mode") for r in ok}},
        "control_overhead_ms_p50": round(float(np.percentile(control, 50)), 2) if control else None,
        "latency_ms": latency, "failures": failures,
    }


def print_summary(s: dict) -> None:
    print(f"requests {s['requests']}  verified {s['verified']}  failed {s['failed']}  wall {s['wall_s']} s  "
          f"{s['requests_per_s']} req/s  {s['gbps']} GB/s aggregate  {s['transfer_gbps']} GB/s per transfer  "
          f"modes {s['modes']}")
    print(f"control overhead p50 (decode wait - transfer): {s['control_overhead_ms_p50']} ms")
    print(f"{'phase':<10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for phase, q in s["latency_ms"].items():
        print(f"{phase:<10} {q['p50']:>9} {q['p90']:>9} {q['p99']:>9} {q['mean']:>9}")
    for reason, n in s["failures"].items():
        print(f"failed x{n}: {reason}")


def run(args: argparse.Namespace) -> int:
    summary = run_workload(args.router, args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0 if summary["failed"] == 0 else 1

