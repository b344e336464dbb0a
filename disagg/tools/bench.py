"""`disagg bench`: drive a router with a workload and summarize it."""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from disagg.router.router import post_json
from disagg.worker.checks import positive_int

HELP = "drive a router with a workload; print throughput, GB/s and latency percentiles"
PHASES = ("total", "bootstrap", "prefill", "transfer", "control", "wait", "verify", "decode", "rebuild", "check")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8000")
    add_workload_flags(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=32, help="requests in all")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at once")
    p.add_argument("--prompt-len", type=prompt_lengths, default="128:1024",
                   help="prompt tokens: N or MIN:MAX (uniform), plain integers")
    p.add_argument("--max-new-tokens", type=positive_int, default=4, help="tokens decode generates per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of latency and throughput")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it goes to stderr)")


def prompt_lengths(spec: str) -> str:
    """--prompt-len N or MIN:MAX with 1 <= MIN <= MAX, plain integers (checked when parsed)."""
    lo, sep, hi = spec.partition(":")
    if not (lo.isdigit() and (hi.isdigit() or not sep) and 1 <= int(lo) <= int(hi or lo)):
        raise argparse.ArgumentTypeError(f"{spec!r}: want N or MIN:MAX with 1 <= MIN <= MAX, plain integers "
                                         f"(e.g. 2048 or 128:4096)")
    return spec


def _lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    lo, _, hi = spec.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--prompt-len: bad range {spec!r}")
    return rng.integers(lo, hi + 1, n).tolist()


def run_workload(router: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    lengths = _lengths(args.prompt_len, args.requests, rng)
    results, finished = [], []
    t0 = time.perf_counter()
    bar = tqdm(total=args.requests, unit="req", disable=args.no_progress, file=sys.stderr, leave=False)
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(post_json, router + "/generate",
                               {"prompt_len": n, "max_new_tokens": args.max_new_tokens, "seed": args.seed + i}, 120)
                   for i, n in enumerate(lengths)]
        for f in as_completed(futures):
            results.append(f.result())
            finished.append(time.perf_counter() - t0)
            bar.update(1)
    bar.close()
    wall = time.perf_counter() - t0
    if args.plot:
        plot(results, finished, args.plot)
    return summarize(results, wall)


def plot(results: list[dict], finished: list[float], path: str) -> None:
    """Latency per request (total and transfer) and completed GB/s over time, as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [(t, r) for t, r in zip(finished, results) if r.get("ok")]
    for phase in ("total", "transfer", "verify"):
        lat.scatter([t for t, _ in ok], [r["timings_ms"][phase] or 0 for _, r in ok], s=8, label=phase)
    lat.set(xlabel="completion time (s)", ylabel="latency (ms)", title="latency per request")
    lat.legend()
    order = np.argsort(finished)
    times = np.asarray(finished)[order]
    cum_bytes = np.cumsum([results[i].get("bytes", 0) if results[i].get("ok") else 0 for i in order])
    thr.plot(times, cum_bytes / np.maximum(times, 1e-9) / 1e9, color="tab:blue")
    thr.set(xlabel="time (s)", ylabel="GB/s so far", title="throughput")
    req = thr.twinx()  # requests/s on its own scale
    req.plot(times, np.arange(1, len(times) + 1) / np.maximum(times, 1e-9), color="tab:orange")
    req.set_ylabel("requests/s so far", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    checked = [r["check"] for r in ok if isinstance(r.get("check"), dict)]
    failures: dict[str, int] = {}
    for r in results:
        if not r.get("ok"):
            key = str(r.get("reason") or r.get("error") or "unknown")   # whole: the end often says why
            failures[key] = failures.get(key, 0) + 1
    return {
        "requests": len(results), "verified": sum(1 for r in ok if r.get("verified")),
        "failed": len(results) - len(ok), "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 2) if wall else 0.0,
        "bytes": total_bytes, "gbps": round(total_bytes / wall / 1e9, 6) if wall else 0.0,
        "transfer_gbps": round(total_bytes / transfer_s / 1e9, 6) if transfer_s else 0.0,
        "modes": {m: sum(1 for r in ok if r.get("mode") == m) for m in {r.get("mode") for r in ok}},
        "transports": {t: sum(1 for r in ok if r.get("transport") == t) for t in {r.get("transport") for r in ok}},
        "latency_ms": latency, "failures": failures,
        # generations compared with a colocated run of the same model (decode --check-rate)
        "token_match": {"checked": len(checked), "match": sum(1 for c in checked if c.get("token_match")),
                        "logits_match": sum(1 for c in checked if c.get("logits_match", c.get("token_match")))},
    }


def print_summary(s: dict) -> None:
    print(f"requests {s['requests']}  verified {s['verified']}  failed {s['failed']}  wall {s['wall_s']} s  "
          f"{s['requests_per_s']} req/s  {s['gbps']} GB/s aggregate  {s['transfer_gbps']} GB/s per transfer  "
          f"modes {s['modes']}  transports {s.get('transports', {})}")
    print("control = prefill done -> KV ready on decode, minus the transfer itself")
    print(f"{'phase':<10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for phase, q in s["latency_ms"].items():
        print(f"{phase:<10} {q['p50']:>9} {q['p90']:>9} {q['p99']:>9} {q['mean']:>9}")
    for reason, n in s["failures"].items():
        print(f"failed x{n}: {reason}")
    m = s.get("token_match", {})
    if m.get("checked"):
        print(f"token_match {m['match']}/{m['checked']}  logits bit-identical {m['logits_match']}/{m['checked']} "
              f"(against the same prompt run colocated)")


def run(args: argparse.Namespace) -> int:
    summary = run_workload(args.router, args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0 if summary["failed"] == 0 and mismatches(summary) == 0 else 1


def mismatches(summary: dict) -> int:
    """Checked generations that differ from the colocated run (tokens or logits)."""
    m = summary.get("token_match", {})
    return m.get("checked", 0) - min(m.get("match", 0), m.get("logits_match", 0))

