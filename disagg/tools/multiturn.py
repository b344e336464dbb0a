"""The multi-turn workload (`disagg bench --workload multiturn`, `disagg demo --workload
multiturn`): chat conversations that resend the whole conversation every turn, which is what a
decode-side prefix cache is for. Each turn's prompt is the previous prompt, the answer decode
gave it and a new user message; every conversation starts with one shared system prompt. How
much a turn can reuse follows from the shape: the system prompt's length (shared by every
conversation), the user messages' length, the answers' length, the number of turns.

Conversations run `--concurrency` at a time, the turns of one in order (a turn needs the
previous answer). The same workload runs through each router given, interleaved by
conversation (a stack with decode's prefix cache on and one with it off: side by side in one
run, under the same conditions), and each is summarized per request, per turn and as a whole: bytes moved, transfer time, TTFT and the
cache hit rate (prefix tokens / prompt tokens), and prefill's: the share of prompt tokens it did
not compute (its own prefix cache) and its compute time."""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from disagg.checks import non_negative_int, positive_int, token_lengths
from disagg.router.router import post_json
from disagg.tools.deployment import router_workers
from disagg.tools.runs import Run

DEFAULT_VOCAB = 50000  # the router's own default (RouterConfig.vocab_size) where no worker says


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=positive_int, default=8, help="multiturn: conversations (a count)")
    p.add_argument("--turns", type=positive_int, default=4, help="multiturn: turns per conversation (a count)")
    p.add_argument(
        "--system-prompt-len",
        type=non_negative_int,
        default=1024,
        metavar="N",
        help="multiturn: tokens of the system prompt every conversation starts with (0: none)",
    )
    p.add_argument(
        "--user-len",
        type=token_lengths,
        default="256",
        metavar="N|MIN:MAX",
        help="multiturn: tokens of each new user message: N, or MIN:MAX drawn uniformly per turn",
    )


@dataclass(frozen=True)
class Shape:
    """What every run of the workload sends: the same prompts' ids and lengths."""

    conversations: int
    turns: int
    system_len: int
    user_len: str  # N or MIN:MAX
    answer_len: int  # max_new_tokens of every turn
    seed: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Shape":
        return cls(
            args.conversations, args.turns, args.system_prompt_len, args.user_len, args.max_new_tokens, args.seed
        )

    def describe(self) -> dict:
        return {
            "conversations": self.conversations,
            "turns": self.turns,
            "system_prompt_tokens": self.system_len,
            "user_tokens": self.user_len,
            "answer_tokens": self.answer_len,
            "seed": self.seed,
        }

    def system_prompt(self, vocab: int) -> list[int]:
        return np.random.default_rng([self.seed, 0]).integers(0, vocab, self.system_len).tolist()

    def user_messages(self, conversation: int, vocab: int) -> list[list[int]]:
        """Conversation c's user messages, one per turn (the same in every run)."""
        rng = np.random.default_rng([self.seed, 1, conversation])
        lo, _, hi = self.user_len.partition(":")
        lengths = rng.integers(int(lo), int(hi or lo) + 1, self.turns)
        return [rng.integers(0, vocab, n).tolist() for n in lengths]


@dataclass(frozen=True)
class Target:
    """A router the workload runs through, labelled by what its decode workers say of their
    prefix cache (/health): reuse_on, reuse_off, or reuse_unknown; `prefill_cache` says the
    same of its prefill workers' (on, off, unknown)."""

    label: str
    url: str
    vocab: int
    prefill_cache: str = "unknown"


def cache_state(healths: list[dict]) -> str:
    """on where every worker's /health shows its prefix cache, off where one does not, unknown for none."""
    return "unknown" if not healths else "on" if all("prefix_cache" in h for h in healths) else "off"


def targets(routers: list[str]) -> list[Target]:
    """Each router with its label (one label twice gets the router's place after it) and the
    vocabulary its workers take (the smallest any reports)."""
    out: list[Target] = []
    for i, url in enumerate(routers):
        workers = router_workers(url)
        decodes = [h for h in workers.values() if h.get("role") == "decode"]
        reuse = cache_state(decodes)
        prefill = cache_state([h for h in workers.values() if h.get("role") == "prefill"])
        vocabs = [h["vocab_size"] for h in workers.values() if type(h.get("vocab_size")) is int]
        label = f"reuse_{reuse}"
        if any(t.label == label for t in out):
            label = f"{label}_{i + 1}"
        out.append(Target(label, url, min(vocabs, default=DEFAULT_VOCAB), prefill))
    return out


def send(targets: list[Target], shape: Shape, concurrency: int, progress: bool, extra: dict | None = None) -> list[Run]:
    """Every conversation through every router (`extra`: more fields of every /generate body),
    interleaved so that no router runs under other conditions than another (a pool touched
    first, a busier machine): conversation c goes through each router in turn, starting with
    router c mod the number of routers, `concurrency` conversations at a time. Each answer is
    the router's with its conversation and turn (from 1) added. Requests that are not counted
    warm each stack up first (their random ids share no prefix with the workload)."""
    vocab = min(t.vocab for t in targets)  # the same ids through every router
    with ThreadPoolExecutor(concurrency) as pool:  # warm-up: as many at once as the workload sends
        list(
            pool.map(
                lambda job: post_json(
                    job[0].url + "/generate", {"prompt_len": 64, "max_new_tokens": 1, "seed": (1 << 40) + job[1]}, 120
                ),
                [(t, i) for t in targets for i in range(concurrency)],
            )
        )
    results: dict[str, list[dict]] = {t.label: [] for t in targets}
    finished: dict[str, list[float]] = {t.label: [] for t in targets}
    bar = tqdm(
        total=shape.conversations * shape.turns * len(targets),
        unit="req",
        disable=not progress,
        file=sys.stderr,
        leave=False,
    )
    t0 = time.perf_counter()

    def talk(job: tuple[int, Target]) -> None:
        c, target = job
        for out in conversation(target.url, c, shape, vocab, extra or {}):
            results[target.label].append(out)
            finished[target.label].append(time.perf_counter() - t0)
            bar.update(1)

    jobs = [(c, targets[(c + k) % len(targets)]) for c in range(shape.conversations) for k in range(len(targets))]
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(talk, jobs))
    finally:
        bar.close()
    wall = time.perf_counter() - t0  # (of every run together: they were interleaved)
    return [Run(t.label, results[t.label], finished[t.label], wall) for t in targets]


def conversation(url: str, c: int, shape: Shape, vocab: int, extra: dict):
    """Conversation c's turns through one router, in order, each answer as it comes: every
    turn resends the conversation so far (the system prompt, then each user message and answer)."""
    prompt: list[int] = shape.system_prompt(vocab)
    for turn, message in enumerate(shape.user_messages(c, vocab), start=1):
        prompt += message
        out = post_json(url + "/generate", {"token_ids": prompt, "max_new_tokens": shape.answer_len, **extra}, 120)
        yield {**out, "conversation": c, "turn": turn, "prompt_tokens": len(prompt)}
        prompt += out.get("output_tokens") or []  # a failed turn's answer is missing: the next goes on


def ttft_ms(result: dict) -> float | None:
    """Prefill taking the request -> decode holding its KV (prefill + kv_ready_after_compute):
    when decode can stream the first token, which prefill computed and sent with the KV."""
    t = result.get("timings_ms") or {}
    if t.get("prefill") is None or t.get("kv_ready_after_compute") is None:
        return None
    return t["prefill"] + t["kv_ready_after_compute"]


def per_request(result: dict) -> dict:
    prompt, prefix = result.get("prompt_tokens", 0), result.get("prefix_tokens") or 0
    cached = result.get("prefill_cached_tokens") or 0
    t = result.get("timings_ms") or {}
    return {
        "conversation": result["conversation"],
        "turn": result["turn"],
        "ok": bool(result.get("ok")),
        "prompt_tokens": prompt,
        "prefix_tokens": prefix,
        "hit_rate": round(prefix / prompt, 4) if prompt else 0.0,
        "prefill_cached_tokens": cached,
        "prefill_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "compute_ms": t.get("prefill"),
        "bytes": result.get("bytes", 0),
        "reused_bytes": result.get("reused_bytes") or 0,
        "transfer_ms": t.get("transfer"),
        "ttft_ms": ttft_ms(result),
        "total_ms": t.get("total"),
    }


def figures(rows: list[dict]) -> dict:
    """Successful requests' figures: hit rate over all their prompt tokens, means per request,
    transfer time and TTFT percentiles."""
    ok = [r for r in rows if r["ok"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(rows),
        "ok": len(ok),
        "prompt_tokens": round(prompt / len(ok), 1) if ok else 0.0,
        "hit_rate": round(sum(r["prefix_tokens"] for r in ok) / prompt, 4) if prompt else 0.0,
        "prefill_hit_rate": round(sum(r["prefill_cached_tokens"] for r in ok) / prompt, 4) if prompt else 0.0,
        "bytes_per_request": round(statistics.fmean(r["bytes"] for r in ok)) if ok else 0,
        "reused_bytes_per_request": round(statistics.fmean(r["reused_bytes"] for r in ok)) if ok else 0,
        "transfer_ms": spread([r["transfer_ms"] for r in ok]),
        "compute_ms": spread([r["compute_ms"] for r in ok]),
        "ttft_ms": spread([r["ttft_ms"] for r in ok]),
    }


def spread(values: list[float | None]) -> dict:
    present = [v for v in values if v is not None]
    if not present:
        return {}
    q = np.percentile(present, [50, 90])
    return {"p50": round(float(q[0]), 3), "p90": round(float(q[1]), 3), "mean": round(statistics.fmean(present), 3)}


def summarize(run: Run, base: dict, prefill_cache: str = "unknown") -> dict:
    """bench's summary of the run (`base`: failures, latency per phase, ...) with the
    multi-turn figures: over all requests, per turn, and each request's (`prefill_cache`: what
    its prefill workers said of their prefix cache)."""
    rows = sorted((per_request(r) for r in run.results), key=lambda r: (r["conversation"], r["turn"]))
    turns = sorted({r["turn"] for r in rows})
    return {
        **base,
        "prefill_cache": prefill_cache,
        **figures(rows),
        "per_turn": [{"turn": t, **figures([r for r in rows if r["turn"] == t])} for t in turns],
        "per_request": rows,
    }


def compare(summaries: dict[str, dict]) -> dict:
    """reuse off / reuse on: how many times fewer bytes, less transfer time, prefill compute
    and TTFT (p50)."""
    on, off = summaries.get("reuse_on"), summaries.get("reuse_off")
    if on is None or off is None:
        return {}

    def times(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    return {
        "bytes_fewer_x": times(off["bytes_per_request"], on["bytes_per_request"]),
        "transfer_ms_p50_less_x": times(off["transfer_ms"].get("p50"), on["transfer_ms"].get("p50")),
        "compute_ms_p50_less_x": times(off["compute_ms"].get("p50"), on["compute_ms"].get("p50")),
        "ttft_ms_p50_less_x": times(off["ttft_ms"].get("p50"), on["ttft_ms"].get("p50")),
    }


def outcome(shape: Shape, summaries: dict[str, dict]) -> dict:
    """What bench --json prints: the workload, each run's summary by label, the comparison."""
    return {"workload": shape.describe(), "runs": summaries, "reuse_on_vs_off": compare(summaries)}


def all_served(out: dict) -> bool:
    """Every request of every run verified, and no colocated check differed."""
    return all(
        s["failed"] == 0 and s["verified"] == s["requests"] and s["token_match"]["differ"] == 0
        for s in out["runs"].values()
    )


# ---- the table -----------------------------------------------------------------------------------
COLUMNS = (("hit %", 6), ("MB/req", 9), ("xfer ms", 9), ("pf hit %", 8), ("comp ms", 9), ("TTFT ms", 9))  # per run


def _cells(f: dict) -> str:
    if not f["ok"]:
        return " ".join(f"{'-':>{w}}" for _, w in COLUMNS)
    values = (
        f"{100 * f['hit_rate']:.1f}",
        f"{f['bytes_per_request'] / 1e6:.3f}",
        _ms(f["transfer_ms"].get("p50")),
        f"{100 * f['prefill_hit_rate']:.1f}",
        _ms(f["compute_ms"].get("p50")),
        _ms(f["ttft_ms"].get("p50")),
    )
    return " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, COLUMNS))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(out: dict) -> None:
    """Per turn and over all turns, each run side by side (p50 times of successful requests),
    then the comparison and each run's failures."""
    w, runs = out["workload"], out["runs"]
    print(
        f"multiturn: {w['conversations']} conversations x {w['turns']} turns; a shared system prompt of "
        f"{w['system_prompt_tokens']} tokens, user messages of {w['user_tokens']}, answers of "
        f"{w['answer_tokens']} tokens"
    )
    width = sum(c + 1 for _, c in COLUMNS) - 1
    names = {
        label: f"{label.replace('_', ' ')} (prefill cache {s.get('prefill_cache', 'unknown')})"
        for label, s in runs.items()
    }
    print(f"{'':<14}" + "".join(f" | {names[label]:<{width}}" for label in runs))
    print(f"{'turn':<5}{'prompt':>9}" + " | ".join([""] + [" ".join(f"{n:>{c}}" for n, c in COLUMNS)] * len(runs)))
    first = next(iter(runs.values()))
    for i, row in enumerate(first["per_turn"]):
        cells = [_cells(s["per_turn"][i]) for s in runs.values()]
        print(f"{row['turn']:<5}{row['prompt_tokens']:>9.0f}" + " | ".join([""] + cells))
    print(f"{'all':<5}{first['prompt_tokens']:>9.0f}" + " | ".join([""] + [_cells(s) for s in runs.values()]))
    print(
        "(hit %: decode's prefix tokens / prompt tokens; MB/req: KV bytes moved per request; xfer: the send, "
        "p50, which holds the compute it overlaps where streamed layer-wise; pf hit %: prompt tokens prefill "
        "did not compute (its prefix cache); comp: prefill's compute, p50; TTFT: prefill taking the request "
        "-> decode holding its KV, p50)"
    )
    if out["reuse_on_vs_off"]:
        on, off = runs["reuse_on"], runs["reuse_off"]
        print(
            f"reuse off -> on: {off['bytes_per_request'] / 1e6:.3f} -> {on['bytes_per_request'] / 1e6:.3f} MB per "
            f"request ({_x(out['reuse_on_vs_off']['bytes_fewer_x'])} fewer), transfer p50 "
            f"{_ms(off['transfer_ms'].get('p50'))} -> {_ms(on['transfer_ms'].get('p50'))} ms, prefill compute "
            f"p50 {_ms(off['compute_ms'].get('p50'))} -> {_ms(on['compute_ms'].get('p50'))} ms, TTFT p50 "
            f"{_ms(off['ttft_ms'].get('p50'))} -> {_ms(on['ttft_ms'].get('p50'))} ms"
        )
    for label, s in runs.items():
        print(
            f"{label}: {s['requests']} requests, {s['verified']} verified, {s['failed']} failed, "
            f"wall {s['wall_s']:.2f} s"
        )
        for reason, n in sorted(s["failures"].items(), key=lambda kv: -kv[1]):
            print(f"  {n} x {reason}")


def _x(value: float | None) -> str:
    return "?" if value is None else f"{value:g}x"
