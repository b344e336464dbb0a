"""`disagg bench`: drive a router with a workload and summarize it."""

import argparse
import json
import math
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from disagg.api.fields import STREAM_LAYERS
from disagg.router.router import post_json
from disagg.tools import multiturn
from disagg.tools.runs import PHASE_MEANING, PHASES, Run
from disagg.checks import positive_int, token_lengths

HELP = "drive a router with a workload; print throughput, GB/s and latency percentiles"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--compare-router",
        default=None,
        metavar="URL",
        help="multiturn: a second router the same workload then runs through, summarized side by side "
        "(e.g. a stack whose decode and prefill run --no-prefix-cache); each is labelled by what its "
        "decode workers say of their prefix cache, and says what its prefill workers say of theirs",
    )
    add_workload_flags(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object (keys name their unit: _ms, _s, _per_s, bytes)",
    )


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="random",
        choices=["random", "multiturn"],
        help="random: --requests prompts of --prompt-len random tokens; multiturn: --conversations "
        "of --turns, each turn resending the conversation so far (see --system-prompt-len, "
        "--user-len), a table per turn of bytes moved, transfer time, prefill compute, TTFT and both "
        "prefix caches' hit rates",
    )
    p.add_argument("--requests", type=positive_int, default=32, help="requests to send in all (a count)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at once (a count)")
    p.add_argument(
        "--prompt-len",
        type=token_lengths,
        default="128:1024",
        help="prompt length in tokens: N, or MIN:MAX drawn uniformly per request (plain integers)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=4, help="tokens decode generates per request")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed (an integer) of the prompt lengths and token ids; request i uses seed+i",
    )
    p.add_argument(
        "--stream-layers",
        default=None,
        choices=[*STREAM_LAYERS, "both"],
        help="layer-wise streaming per request: on, off, auto, or both (the workload twice, off then "
        "on, each summarized); unset, prefill's --stream-layers decides",
    )
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="write a PNG file here: latency per phase and throughput over time"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it goes to stderr)")
    multiturn.add_flags(p)


def _lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    lo, _, hi = spec.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--prompt-len: bad range {spec!r}")
    return rng.integers(lo, hi + 1, n).tolist()


def run_workloads(router: str, args: argparse.Namespace) -> dict[str, dict]:
    """The workload once, or with --stream-layers both twice (off, then on): label -> summary.
    With --plot, one PNG shows every run."""
    if args.stream_layers != "both":
        return {"": run_workload(router, args)}
    runs = [
        send_workload(router, argparse.Namespace(**{**vars(args), "stream_layers": mode}), f"stream_{mode}")
        for mode in ("off", "on")
    ]
    write_plot(runs, args)
    return {run.label: summarize(run.results, run.wall) for run in runs}


def run_multiturn(routers: list[str], args: argparse.Namespace) -> dict:
    """The multi-turn workload through every router, interleaved (plotted with --plot),
    summarized side by side (multiturn.outcome)."""
    if args.stream_layers == "both":
        raise SystemExit(
            "--stream-layers both runs the random workload twice; with --workload multiturn give on, off or auto"
        )
    shape = multiturn.Shape.of(args)
    extra = {"stream_layers": args.stream_layers} if args.stream_layers else {}
    targets = multiturn.targets(routers)
    runs = multiturn.send(targets, shape, args.concurrency, not args.no_progress, extra)
    write_plot(runs, args)
    prefill = {t.label: t.prefill_cache for t in targets}
    return multiturn.outcome(
        shape,
        {run.label: multiturn.summarize(run, summarize(run.results, run.wall), prefill[run.label]) for run in runs},
    )


def run_workload(router: str, args: argparse.Namespace) -> dict:
    """Send the workload (plotted with --plot) and summarize it."""
    run = send_workload(router, args)
    write_plot([run], args)
    return summarize(run.results, run.wall)


def write_plot(runs: list[Run], args: argparse.Namespace) -> None:
    if args.plot:
        from disagg.tools.plot import plot, plot_title

        plot(runs, args.plot, plot_title(args, runs))
        print(f"plot written to {args.plot}", file=sys.stderr)  # stderr: --json keeps stdout to itself


def send_workload(router: str, args: argparse.Namespace, label: str = "") -> Run:
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
        futures = [
            pool.submit(
                post_json,
                router + "/generate",
                {"prompt_len": n, "max_new_tokens": args.max_new_tokens, "seed": args.seed + i, **extra},
                120,
            )
            for i, n in enumerate(lengths)
        ]
        for f in as_completed(futures):
            results.append(f.result())
            finished.append(time.perf_counter() - t0)
            bar.update(1)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # requests already sent end on their own
        raise
    finally:
        bar.close()
    pool.shutdown()
    return Run(label, results, finished, time.perf_counter() - t0)


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
            latency[phase] = {
                "p50": round(q[0], 2),
                "p90": round(q[1], 2),
                "p99": round(q[2], 2),
                "mean": round(statistics.fmean(values), 2),
            }
    checked = [r["check"] for r in results if isinstance(r.get("check"), dict)]  # a mismatch fails its request
    failures, failure_rooms = group_failures([r for r in results if not r.get("ok")])
    return {
        "requests": len(results),
        "verified": sum(1 for r in ok if r.get("verified")),
        "failed": len(results) - len(ok),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 2) if wall else 0.0,
        "bytes": total_bytes,
        "gb_per_s": round(total_bytes / wall / 1e9, 6) if wall else 0.0,
        "transfer_gb_per_s": round(total_bytes / transfer_s / 1e9, 6) if transfer_s else 0.0,
        "modes": {m: sum(1 for r in ok if r.get("mode") == m) for m in {r.get("mode") for r in ok}},
        "transports": {t: sum(1 for r in ok if r.get("transport") == t) for t in {r.get("transport") for r in ok}},
        "streamed": sum(1 for r in ok if r.get("streamed")),
        "prepared_ahead": sum(1 for r in ok if r.get("prepared_ahead")),
        "latency_ms": latency,
        "failures": failures,
        "failure_rooms": failure_rooms,
        "token_match": check_counts(checked),
    }


def check_counts(checks: list[dict]) -> dict:
    """Generations compared with a colocated run (decode --check-rate). Logits are counted only
    where a check compared them: the stand-in engine has none, so its checks are tokens only."""
    with_logits = [c for c in checks if "logits_match" in c]
    with_shard = [c for c in checks if "shard_match" in c]  # the bytes each decode rank held: its shard
    return {
        "checked": len(checks),
        "match": sum(1 for c in checks if c.get("token_match")),
        "logits_checked": len(with_logits),
        "logits_match": sum(1 for c in with_logits if c["logits_match"]),
        "shard_checked": len(with_shard),
        "shard_match": sum(1 for c in with_shard if c["shard_match"]),
        "differ": sum(
            1
            for c in checks
            if not (c.get("token_match") and c.get("logits_match", True) and c.get("shard_match", True))
        ),
    }


ROOM = re.compile(r"\b(rooms?) (\d+)")


def group_failures(failed: list[dict]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Failure reasons -> count, and a few example rooms of each. Reasons are kept whole (the
    end often says why) but a room number is replaced by `*`, so one cause is one line however
    many rooms it hit."""
    counts: dict[str, int] = {}
    rooms: dict[str, list[int]] = {}
    for r in failed:
        reason = str(r.get("reason") or r.get("error") or "unknown")
        key = ROOM.sub(r"\1 *", reason)
        counts[key] = counts.get(key, 0) + 1
        room = (
            r.get("room")
            if isinstance(r.get("room"), int)
            else next((int(m.group(2)) for m in ROOM.finditer(reason)), None)
        )
        examples = rooms.setdefault(key, [])
        if room is not None and room not in examples and len(examples) < EXAMPLE_ROOMS:
            examples.append(room)
    return counts, {k: v for k, v in rooms.items() if v}


EXAMPLE_ROOMS = 3


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
        _print_failures(s["failures"], s.get("failure_rooms", {}))
        return
    print(
        f"requests {s['requests']}  verified {s['verified']}  failed {s['failed']}  "
        f"wall {s['wall_s']:.2f} s  {significant(s['requests_per_s'])} req/s"
    )
    print(
        f"throughput: {significant(s['gb_per_s'])} GB/s aggregate (KV bytes / wall), "
        f"{significant(s['transfer_gb_per_s'])} GB/s per transfer (KV bytes / time in transfers)"
    )
    print(
        f"modes: {_counts(s['modes']) or 'none'}   transports: {_counts(s.get('transports', {})) or 'none'}   "
        f"streamed layer-wise: {s.get('streamed', 0)}   sends prepared while computing: "
        f"{s.get('prepared_ahead', 0)}"
    )
    lat = s["latency_ms"]
    if lat:
        print()
        width = max(len("phase"), *(len(p) for p in lat))  # the longest name sets the column
        print(f"{'phase':<{width}} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}   (successful requests)")
        for phase, q in lat.items():
            print(f"{phase:<{width}} {q['p50']:>9.1f} {q['p90']:>9.1f} {q['p99']:>9.1f} {q['mean']:>9.1f}")
        print()
        for phase in lat:
            print(f"  {phase:<{width}}  {PHASE_MEANING.get(phase, '')}")
    if s["failures"]:
        print()
        print(f"{s['failed']} of {s['requests']} requests failed; reasons:")
        _print_failures(s["failures"], s.get("failure_rooms", {}))
    m = s.get("token_match", {})
    if m.get("checked"):
        print(check_line(m))


def check_line(m: dict) -> str:
    """What the colocated comparison compared: logits only where the engine has them."""
    if m.get("logits_checked"):
        logits = f"  logits bit-identical {m['logits_match']}/{m['logits_checked']}"
    else:
        logits = " (tokens only: the engine has no logits to compare)"
    shard = f"  shard bytes {m['shard_match']}/{m['shard_checked']}" if m.get("shard_checked") else ""
    return f"token_match {m['match']}/{m['checked']}{logits}{shard} (against the same prompt run colocated)"


def _print_failures(failures: dict[str, int], rooms: dict[str, list[int]]) -> None:
    """One line per reason (room numbers as `*`), most frequent first, with a few of its rooms;
    reasons whole (their end often says why)."""
    width = len(str(max(failures.values(), default=0)))
    for reason, n in sorted(failures.items(), key=lambda kv: (-kv[1], kv[0])):
        some = rooms.get(reason, [])
        more = ", ..." if n > len(some) and some else ""
        print(f"  {n:>{width}} x {reason}" + (f"  [rooms {', '.join(map(str, some))}{more}]" if some else ""))


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
        print(
            f"KV ready after compute, p50: {significant(after['stream_off'])} ms not streamed, "
            f"{significant(after['stream_on'])} ms streamed layer-wise"
        )


def one_json(summaries: dict[str, dict]) -> dict:
    return summaries[""] if "" in summaries else summaries


def run(args: argparse.Namespace) -> int:
    if args.compare_router and args.workload != "multiturn":  # (it would be left unused without a word)
        raise SystemExit(
            "--compare-router runs the multiturn workload through a second router: give --workload multiturn"
        )
    if args.plot:  # the plot's title names the preset: the workers behind the router know it
        from disagg.tools.deployment import router_preset

        args.preset = router_preset(args.router)
    if args.workload == "multiturn":
        out = run_multiturn([args.router, *([args.compare_router] if args.compare_router else [])], args)
        if args.json:
            print(json.dumps(out))
        else:
            multiturn.print_table(out)
        return 0 if multiturn.all_served(out) else 1
    summaries = run_workloads(args.router, args)
    if args.json:
        print(json.dumps(one_json(summaries)))
    else:
        print_summaries(summaries)
    return 0 if all(s["failed"] == 0 and mismatches(s) == 0 for s in summaries.values()) else 1


def mismatches(summary: dict) -> int:
    """Checked generations that differ from the colocated run (tokens, logits or the bytes held)."""
    return summary.get("token_match", {}).get("differ", 0)
