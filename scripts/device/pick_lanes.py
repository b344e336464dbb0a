#!/usr/bin/env python3
"""Reads bench_lanes.py's output (kernels named base, then variants NAME=PATH:DEFINE=1...) and,
where a variant beats base on the narrow TP slices (8:1 and 8:2 summed) by at least --margin
with its bytes equal and no pair slower by more than --margin, sets its defines as the kernel
source's defaults (#define X 0 -> 1) so that what runs next (bench_tp, the tests) uses it.
Prints the choice; the same change must then be made in the repository by hand.

    python3 scripts/device/pick_lanes.py LANES_TXT KERNEL_CU --variants pre=LANE_PREFETCH,both=...
"""

import argparse
import re
import sys
from pathlib import Path


def times(text: str) -> tuple[dict[str, dict[str, float]], set[str]]:
    """pair -> kernel name -> ms (the first block count listed), and the kernels whose bytes
    differed from base's on any pair (never chosen)."""
    out: dict[str, dict[str, float]] = {}
    differ: set[str] = set()
    for line in text.splitlines():
        pair = line.split(" ", 1)[0]
        if not re.fullmatch(r"\d+:\d+", pair):
            continue
        for name, ms, bad in re.findall(r"\| (\w+) x\d+ ([\d.]+) ms\s+\d+ GB/s( BYTES DIFFER)?", line):
            out.setdefault(pair, {}).setdefault(name, float(ms))
            if bad:
                differ.add(name)
    return out, differ


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lanes")
    ap.add_argument("kernel")
    ap.add_argument("--variants", required=True, help="name=DEFINE[+DEFINE], comma-separated")
    ap.add_argument("--margin", type=float, default=0.05)
    args = ap.parse_args()
    t, differ = times(Path(args.lanes).read_text())
    narrow = [p for p in ("8:1", "8:2") if p in t and "base" in t[p]]
    if not narrow:
        print("pick: no 8:1/8:2 rows with base: keeping the defaults")
        return 0
    best, best_ms = "base", sum(t[p]["base"] for p in narrow)
    for spec in args.variants.split(","):
        name, defines = spec.split("=")
        if name in differ or not all(name in t[p] for p in t if "base" in t[p]):
            continue
        ms = sum(t[p][name] for p in narrow)
        worse = any(t[p][name] > t[p]["base"] * (1 + args.margin) for p in t if "base" in t[p])
        if not worse and ms < best_ms * (1 - args.margin) and ms < best_ms:
            best, best_ms, chosen = name, ms, defines
    base_ms = sum(t[p]["base"] for p in narrow)
    print(f"pick: {best} ({best_ms:.3f} ms on {'+'.join(narrow)} against base {base_ms:.3f} ms)")
    if best != "base":
        src = Path(args.kernel).read_text()
        for d in chosen.split("+"):
            src, n = re.subn(rf"#define {d} 0\b", f"#define {d} 1", src)
            print(f"pick: #define {d} 1 ({n} replaced)")
        Path(args.kernel).write_text(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
