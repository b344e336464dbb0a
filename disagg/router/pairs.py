"""What the router sends a request through: a Pair of instances (a prefill instance and a
decode instance, each one worker URL per TP rank), and one instance's answer merged from its
ranks' answers.

    --pair http://p0:8080+http://p1:8080,http://d0:8080,main
           |-- prefill TP 2 ---------------| |-- decode TP 1 -| bootstrap
"""

import argparse
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """A prefill instance and a decode instance: each one worker URL per TP rank (every rank
    of both takes part in every request), and the bootstrap decode looks prefill up at."""
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    bootstrap: str

    def __post_init__(self) -> None:   # one URL: an instance of one rank
        for side in ("prefill", "decode"):
            if isinstance(getattr(self, side), str):
                object.__setattr__(self, side, (getattr(self, side),))

    @staticmethod
    def parse(text: str) -> "Pair":
        """--pair PREFILL_URL[+URL...],DECODE_URL[+URL...],BOOTSTRAP (a name decode knows, or
        its address); several URLs on a side are that instance's TP ranks."""
        parts = text.split(",")
        if len(parts) != 3 or not all(parts):
            raise argparse.ArgumentTypeError(f"want PREFILL_URL,DECODE_URL,BOOTSTRAP (e.g. http://10.0.0.5:8080,"
                                             f"http://10.0.0.6:8080,main; ranks of a TP instance joined by +), "
                                             f"got {text!r}")
        sides = [tuple(part.split("+")) for part in parts[:2]]
        for url in (u for side in sides for u in side):
            try:
                parsed = urllib.parse.urlsplit(url)
                port = parsed.port
            except ValueError:
                port = None
            if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
                raise argparse.ArgumentTypeError(f"{url!r} is not http://HOST:PORT")
        for side in sides:
            if len(set(side)) != len(side):
                raise argparse.ArgumentTypeError(f"{'+'.join(side)}: a rank's URL given twice")
        return Pair(sides[0], sides[1], parts[2])

    def __str__(self) -> str:   # as --pair takes it
        return f"{'+'.join(self.prefill)},{'+'.join(self.decode)},{self.bootstrap}"


def side_name(role: str, rank: int, pair: Pair) -> str:
    return f"{role} rank {rank}" if len(getattr(pair, role)) > 1 else role


def merge_ranks(outs: list[dict]) -> dict:
    """One instance's answer from its ranks' answers: the first failure if any rank failed (its
    reason naming the rank); else rank 0's, with bytes summed, times the slowest rank's (the
    ranks work at once) and the check of the first rank whose check failed. Decode ranks must
    agree on the tokens they generated."""
    if len(outs) == 1:
        return outs[0]
    for rank, out in enumerate(outs):
        if out.get("state") != "SUCCESS":
            return {**out, "reason": f"rank {rank}: {out.get('reason', '')}"}
    tokens = [out.get("output_tokens") for out in outs]
    if any(t != tokens[0] for t in tokens):
        return {**outs[0], "state": "FAILED", "reason": f"the decode ranks generated different tokens: {tokens}"[:500]}
    merged = {**outs[0], "bytes": sum(out.get("bytes") or 0 for out in outs), "ranks": len(outs),
              "streamed": any(out.get("streamed") for out in outs),
              # every rank that sent prepared its send ahead (a rank that feeds no decode rank sent nothing)
              "prepared_ahead": all(out["prepared_ahead"] for out in outs if "prepared_ahead" in out)
              and any("prepared_ahead" in out for out in outs),
              "verified": all(out.get("verified") for out in outs) if "verified" in outs[0] else None}
    checks = [(rank, out["check"]) for rank, out in enumerate(outs) if isinstance(out.get("check"), dict)]
    if checks:   # each decode rank checks its own shard: the first one that differs speaks for all
        bad = [(r, c) for r, c in checks if not (c.get("token_match") and c.get("logits_match", True))]
        rank, check = (bad or checks)[0]
        merged["check"] = {**check, "ranks_checked": len(checks), **({"rank": rank} if bad else {})}
    for key, pick in (("first_write_at", min), *((k, max) for k in _SLOWEST)):
        values = [out[key] for out in outs if isinstance(out.get(key), (int, float))]
        if values:
            merged[key] = pick(values)
    return merged


_SLOWEST = ("prefill_ms", "prefill_done_at", "transfer_ms", "after_compute_ms", "bootstrap_ms", "wait_ms",
            "verify_ms", "decode_ms", "rebuild_ms", "check_ms", "kv_ready_at",
            "transfer_end_at")   # issue 40: the last rank's send end starts the control phase (phases.py)
