"""`disagg bench`: drive a router with a workload and summarize it."""

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from disagg.api.fields import STREAM_LAYERS
from disagg.router.router import post_json
from disagg.worker.checks import positive_int

HELP = "drive a router with a workload; print throughput, GB/s and latency percentiles"
PHASES = ("total", "bootstrap", "prefill", "transfer", "transfer_cpu", "kv_ready_after_compute", "control", "wait",
          "verify", "decode", "rebuild", "check")
# What each timings_ms key of a router answer measures (disagg/router/router.py merges them);
# the summary's legend prints the line of every phase in its table.
PHASE_MEANING = {
    "total": "router: the whole request, both sides, as the router saw it",
    "bootstrap": "decode: request in -> its prefill peer known (a lookup; ~0 once cached)",
    "prefill": "prefill: request in -> prompt KV computed into its pool (with any wait for pool space)",
    "transfer": "prefill: the transport moving the KV into decode's pool",
    "transfer_cpu": "prefill: CPU time of the thread that sent the KV (planning, submitting, waiting that "
                    "spins), the host work a streamed send puts beside the compute",
    "kv_ready_after_compute": "prefill compute done -> KV ready on decode: what layer-wise streaming hides "
                              "(transfer + control when not streamed)",
    "control": "hand-off overhead: prefill done -> KV ready on decode, minus the part of the transfer after "
               "compute",
    "wait": "decode: destination sent to prefill -> KV arrived; runs alongside prefill, so it holds the rest "
            "of prefill + transfer + control",
    "verify": "decode: checking that the KV received is this prompt's (the stand-in engine compares every "
              "byte), a digest per component",
    "decode": "decode: generating --max-new-tokens tokens from the received KV (rebuild included; on a model "
              "engine's TP rank also the prompt computed for the other ranks' units)",
    "rebuild": "decode, model engine: reading the pool into the model's cache before the first step",
    "check": "decode, --check-rate: the same prompt run colocated and compared (tokens, logits)",
}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8000")
    add_workload_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object (keys name their unit: _ms, _s, _per_s, bytes)")


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=32, help="requests to send in all (a count)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at once (a count)")
    p.add_argument("--prompt-len", type=prompt_lengths, default="128:1024",
                   help="prompt length in tokens: N, or MIN:MAX drawn uniformly per request (plain integers)")
    p.add_argument("--max-new-tokens", type=positive_int, default=4, help="tokens decode generates per request")
    p.add_argument("--seed", type=int, default=0,
                   help="seed (an integer) of the prompt lengths and token ids; request i uses seed+i")
    p.add_argument("--stream-layers", default=None, choices=[*STREAM_LAYERS, "both"],
                   help="layer-wise streaming per request: on, off, auto, or both (the workload twice, off then "
                        "on, each summarized); unset, prefill's --stream-layers decides")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write a PNG file here: latency per phase and throughput over time")
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


def run_workloads(router: str, args: argparse.Namespace) -> dict[str, dict]:
    """The workload once, or with --stream-layers both twice (off, then on): label -> summary."""
    if args.stream_layers != "both":
        return {"": run_workload(router, args)}
    return {f"stream_{mode}": run_workload(router, argparse.Namespace(**{**vars(args), "stream_layers": mode}))
            for mode in ("off", "on")}


def run_workload(router: str, args: argparse.Namespace) -> dict:
    """Send the workload, `args.concurrency` at a time; on Ctrl-C or an error, requests not
    yet sent are cancelled and the exception goes up at once (the caller's cleanup runs)."""
    rng = np.random.default_rng(args.seed)
    lengths = _lengths(args.prompt_len, args.requests, rng)
    results, finished = [], []
    t0 = time.perf_counter()
    bar = tqdm(total=args.requests, unit="req", disable=args.no_progress, file=sys.stderr, leave=False)
    pool = ThreadPoolExecutor(args.concurrency)
    try:
        extra = {"stream_layers": args.stream_layers} if getattr(args, "stream_layers", None) else {}
        futures = [pool.submit(post_json, router + "/generate",
                               {"prompt_len": n, "max_new_tokens": args.max_new_tokens, "seed": args.seed + i, **extra},
                               120)
                   for i, n in enumerate(lengths)]
        for f in as_completed(futures):
            results.append(f.result())
            finished.append(time.perf_counter() - t0)
            bar.update(1)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)   # requests already sent end on their own
        raise
    finally:
        bar.close()
    pool.shutdown()
    wall = time.perf_counter() - t0
    if args.plot:
        from disagg.tools.plot import plot, plot_title
        plot(results, finished, wall, args.plot, plot_title(args, results))
        print(f"plot written to {args.plot}", file=sys.stderr)   # stderr: --json keeps stdout to itself
    return summarize(results, wall)


# ---- the summary ---------------------------------------------------------------------------------
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
    checked = [r["check"] for r in results if isinstance(r.get("check"), dict)]   # a mismatch fails its request
    failures: dict[str, int] = {}
    for r in results:
        if not r.get("ok"):
            key = str(r.get("reason") or r.get("error") or "unknown")   # whole: the end often says why
            failures[key] = failures.get(key, 0) + 1
    return {
        "requests": len(results), "verified": sum(1 for r in ok if r.get("verified")),
        "failed": len(results) - len(ok), "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 2) if wall else 0.0,
        "bytes": total_bytes, "gb_per_s": round(total_bytes / wall / 1e9, 6) if wall else 0.0,
        "transfer_gb_per_s": round(total_bytes / transfer_s / 1e9, 6) if transfer_s else 0.0,
        "modes": {m: sum(1 for r in ok if r.get("mode") == m) for m in {r.get("mode") for r in ok}},
        "transports": {t: sum(1 for r in ok if r.get("transport") == t) for t in {r.get("transport") for r in ok}},
        "streamed": sum(1 for r in ok if r.get("streamed")),
        "prepared_ahead": sum(1 for r in ok if r.get("prepared_ahead")),
        "latency_ms": latency, "failures": failures,
        # generations compared with a colocated run of the same model (decode --check-rate)
        "token_match": {"checked": len(checked), "match": sum(1 for c in checked if c.get("token_match")),
                        "logits_match": sum(1 for c in checked if c.get("logits_match", c.get("token_match")))},
    }


def significant(x: float, digits: int = 3) -> str:
    """`x` to `digits` significant figures, never in exponent notation (0.000276, 18.6, 262)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def _counts(d: dict) -> str:
    """{'direct': 60, 'staged': 4} -> 'direct 60, staged 4' (largest first)."""
    return ", ".join(f"{k or 'unknown'} {n}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def print_summary(s: dict) -> None:
    if s["requests"] and s["failed"] == s["requests"]:
        print(f"all {s['requests']} requests failed (wall {s['wall_s']:.2f} s); reasons:")
        _print_failures(s["failures"])
        return
    print(f"requests {s['requests']}  verified {s['verified']}  failed {s['failed']}  "
          f"wall {s['wall_s']:.2f} s  {significant(s['requests_per_s'])} req/s")
    print(f"throughput: {significant(s['gb_per_s'])} GB/s aggregate (KV bytes / wall), "
          f"{significant(s['transfer_gb_per_s'])} GB/s per transfer (KV bytes / time in transfers)")
    print(f"modes: {_counts(s['modes']) or 'none'}   transports: {_counts(s.get('transports', {})) or 'none'}   "
          f"streamed layer-wise: {s.get('streamed', 0)}   sends prepared while computing: "
          f"{s.get('prepared_ahead', 0)}")
    lat = s["latency_ms"]
    if lat:
        print()
        print(f"{'phase':<10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}   (successful requests)")
        for phase, q in lat.items():
            print(f"{phase:<10} {q['p50']:>9.1f} {q['p90']:>9.1f} {q['p99']:>9.1f} {q['mean']:>9.1f}")
        print()
        width = max(len(p) for p in lat)
        for phase in lat:
            print(f"  {phase:<{width}}  {PHASE_MEANING.get(phase, '')}")
    if s["failures"]:
        print()
        print(f"{s['failed']} of {s['requests']} requests failed; reasons:")
        _print_failures(s["failures"])
    m = s.get("token_match", {})
    if m.get("checked"):
        print(f"token_match {m['match']}/{m['checked']}  logits bit-identical {m['logits_match']}/{m['checked']} "
              f"(against the same prompt run colocated)")


def _print_failures(failures: dict[str, int]) -> None:
    """One line per reason, most frequent first; reasons whole (their end often says why)."""
    width = len(str(max(failures.values(), default=0)))
    for reason, n in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:>{width}} x {reason}")


def print_summaries(summaries: dict[str, dict]) -> None:
    """One summary, or each under its label and the streaming comparison after them."""
    for label, s in summaries.items():
        if label:
            print(f"== {label.replace('_', ' ')} ==")
        print_summary(s)
        if label:
            print()
    after = {label: s["latency_ms"].get("kv_ready_after_compute", {}).get("p50") for label, s in summaries.items()}
    if len(after) == 2 and all(v is not None for v in after.values()):
        print(f"KV ready after compute, p50: {significant(after['stream_off'])} ms not streamed, "
              f"{significant(after['stream_on'])} ms streamed layer-wise")


def one_json(summaries: dict[str, dict]) -> dict:
    return summaries[""] if "" in summaries else summaries


def run(args: argparse.Namespace) -> int:
    summaries = run_workloads(args.router, args)
    if args.json:
        print(json.dumps(one_json(summaries)))
    else:
        print_summaries(summaries)
    return 0 if all(s["failed"] == 0 and mismatches(s) == 0 for s in summaries.values()) else 1


def mismatches(summary: dict) -> int:
    """Checked generations that differ from the colocated run (tokens or logits)."""
    m = summary.get("token_match", {})
    return m.get("checked", 0) - min(m.get("match", 0), m.get("logits_match", 0))
