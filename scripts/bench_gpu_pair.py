#!/usr/bin/env python3
"""The same-host GPU benchmark: every figure the cuda-ipc transport is judged by, on a machine
with two GPUs of one host (prefill's pool on GPU 0, decode's on GPU 1), one JSON file out per
run (command, machine and date inside it).

    .venv/bin/python scripts/bench_gpu_pair.py --out pair.json                # transfer, then demo
    .venv/bin/python scripts/bench_gpu_pair.py --parts transfer --out t.json  # ~5-6 min
    .venv/bin/python scripts/bench_gpu_pair.py --parts demo --out demo.json   # ~4-5 min
(the Python that has torch, CuPy and this package: scripts/setup.sh's .venv, or an image's python3)
(times on one H100 shared by both sides; where a command may run 10 minutes, a part each)

parts (each a subprocess with its own time limit; a part that fails is recorded and the
rest still run):
  transfer  scripts/bench_transfer.py --transport cuda-ipc: gpt-oss-120b at 2k and 32k tokens,
            pages 1/16/64, both layouts; Qwen3-Next (pages 1, 64) and DeepSeek-V3.2 (page 64)
            at 32k. Per row the p2p ceiling (one block of the same bytes between the same two
            processes, measured beside it), the whole send, and the send prepared ahead (what
            decode waits once the KV is final). Target: ahead >= 0.85 x the ceiling.
  anchor    (not run by default) gpt-oss rows at 32k, pages 1 and 16, over Mooncake's
            intra-node NVLink transport (MC_INTRANODE_NVLINK=1): ours should be >= 7x its paged
            rows. With the cuda13 0.3.14 wheel its submissions are refused (batch id 0) on one
            H100 and on two H200s alike, so the anchor figures are still those of
            ../shared/gpu-notes.md (Mooncake's own probe).
  demo      `disagg demo` (real prefill, decode and router processes, stand-in engine with
            0.5 ms per layer): 2k and 32k tokens at concurrency 1 and 8, plus 32k streamed:
            transfer p50/p99, GB/s, KV ready after compute, control overhead.
Every row is verified byte for byte on decode; the exit code is 1 if any row was not.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET, ANCHOR_X = 0.85, 7.0
TRANSFER = [  # (preset, tokens, page sizes, repeats): one process each
    ("gpt-oss-120b", "2048", "1,16,64", 10),
    ("gpt-oss-120b", "32768", "1,16,64", 10),
    ("qwen3-next-80b-a3b", "32768", "1,64", 5),
    ("deepseek-v3.2", "32768", "64", 5),
]
ANCHOR = [("gpt-oss-120b", "32768", "1,16", 3)]  # Mooncake moves 2 KiB fragments at < 1 GB/s: few repeats
DEMO = [  # (name, prompt tokens, requests, concurrency, stream layers)
    ("2k_c1", 2048, 32, 1, "off"),
    ("2k_c8", 2048, 64, 8, "off"),
    ("32k_c1", 32768, 8, 1, "off"),
    ("32k_c8", 32768, 16, 8, "off"),
    ("32k_c1_streamed", 32768, 8, 1, "on"),
]


def machine() -> str:
    import torch

    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return f"{n} x {', '.join(names)}; torch {torch.__version__}"


def call(cmd: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run one benchmark process; its stdout is its JSON (None and why, if not). It runs in a
    process group of its own: past its limit the whole group (its peer, prefill, decode and
    router processes, which hold GPU pools) is stopped, not only the process started here."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the demo's launcher stops its servers on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        return None, f"ran past its {timeout:.0f} s limit; its last output: {(stderr or stdout or '')[-1200:]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived it
        except ProcessLookupError:
            pass
    text = stdout.strip()
    for candidate in (text, text.splitlines()[-1] if text else ""):  # indented JSON, or a last line
        try:
            found = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found, ""
    return None, f"exit {proc.returncode}: {(stderr or stdout)[-1500:]}"


def transfer_rows(transport: str, args) -> dict:
    found = {}
    for preset, tokens, pages, repeats in TRANSFER if transport == "cuda-ipc" else ANCHOR:
        cmd = [
            sys.executable,
            "scripts/bench_transfer.py",
            "--device",
            "cuda",
            "--transport",
            transport,
            "--json",
            "--preset",
            preset,
            "--tokens",
            tokens,
            "--page-sizes",
            pages,
            "--repeats",
            str(repeats),
        ]
        if transport == "mooncake":
            cmd.append("--mooncake-nvlink")  # MC_INTRANODE_NVLINK=1 on both sides
        t0 = time.perf_counter()
        result, why = call(cmd, args.timeout)
        found[f"{preset}@{tokens}"] = {
            "command": " ".join(cmd[1:]),
            "wall_s": round(time.perf_counter() - t0, 1),
            **({"rows": result["rows"], "gpus": result.get("gpus")} if result else {"error": why}),
        }
        print(f"  {transport} {preset} {tokens}: {'ok' if result else 'FAILED ' + why[-300:]}", flush=True)
    return found


def demo_rows(args) -> dict:
    found = {}
    for name, tokens, requests, concurrency, stream in DEMO:
        cmd = [
            sys.executable,
            "-m",
            "disagg",
            "demo",
            "--device",
            "cuda",
            "--preset",
            "gpt-oss-120b",
            "--max-tokens",
            "300000",
            "--max-requests",
            "16",
            "--requests",
            str(requests),
            "--concurrency",
            str(concurrency),
            "--prompt-len",
            str(tokens),
            "--max-new-tokens",
            "1",
            "--simulate-layer-ms",
            "0.5",
            "--stream-layers",
            stream,
            "--no-progress",
            "--json",
        ]
        result, why = call(cmd, args.timeout)
        if result is None:
            found[name] = {"command": " ".join(cmd[1:]), "error": why}
        else:
            lat = result.get("latency_ms", {})
            found[name] = {
                "command": " ".join(cmd[1:]),
                "requests": result["requests"],
                "verified": result["verified"],
                "streamed": result.get("streamed"),
                "prepared_ahead": result.get("prepared_ahead"),
                "transports": result.get("transports"),
                "transfer_gb_per_s": result.get("transfer_gb_per_s"),
                "failed": result.get("failed"),
                "failures": result.get("failures"),
                **{
                    f"{phase}_ms": lat.get(phase)
                    for phase in ("transfer", "kv_ready_after_compute", "control", "prefill")
                },
            }
        print(f"  demo {name}: {'ok' if result else 'FAILED ' + why[-300:]}", flush=True)
    return found


def report(out: dict, two_gpus: bool = True) -> bool:
    """Print the figures against the targets (on one GPU there is no NVLink ceiling to hold
    them to); True if every row was verified."""
    ok = True
    anchor = {
        (r["layout"], r["page_size"], r["tokens"]): max(r["gbps"], r["ahead_gbps"])
        for p in out.get("anchor", {}).values()
        for r in p.get("rows", [])
    }
    for key, p in out.get("transfer", {}).items():
        preset = key.split("@")[0]
        for r in p.get("rows", []):
            ok &= r["verified"]
            mc = anchor.get((r["layout"], r["page_size"], r["tokens"])) if preset == "gpt-oss-120b" else None
            times = r["ahead_gbps"] / mc if mc else 0.0
            verdict = ("meets" if times >= ANCHOR_X else "below") if r["page_size"] > 1 else "(no target)"
            vs = f"  {times:6.1f}x Mooncake nvlink {verdict}" if mc else ""
            print(
                f"{preset:<20} {r['layout']:<12} page {r['page_size']:>3} {r['tokens']:>6} tok  ceiling "
                f"{r['ceiling_gbps']:6.1f} GB/s  whole {r['ratio']:.2f}  ahead {r['ahead_ratio']:.2f} "
                f"({r['ahead_ms']:.2f} ms) "
                f"{('meets ' if r['ahead_ratio'] >= TARGET else 'below ') + str(TARGET) if two_gpus else ''}"
                f"{vs}{'' if r['verified'] else '  NOT VERIFIED'}"
            )
    for name, d in out.get("demo", {}).items():
        if "error" in d:
            continue
        ok &= d["verified"] == d["requests"]
        if d.get("failures"):
            print(f"demo {name}: failed requests {json.dumps(d['failures'])[:600]}")
        f = {k: (d[k] or {}).get("p50") for k in ("transfer_ms", "kv_ready_after_compute_ms", "control_ms")}
        print(
            f"demo {name:<16} {d['verified']}/{d['requests']} verified  transfer p50 {f['transfer_ms']} "
            f"p99 {(d['transfer_ms'] or {}).get('p99')} ms  {d['transfer_gb_per_s'] or 0:.1f} GB/s  KV ready after "
            f"compute {f['kv_ready_after_compute_ms']} ms  control {f['control_ms']} ms"
        )
    failed = [
        f"{part} {k}" for part in ("transfer", "anchor", "demo") for k, v in out.get(part, {}).items() if "error" in v
    ]
    if failed:
        print("failed: " + ", ".join(failed))
    return ok and not any(k.startswith(("transfer", "demo")) for k in failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="transfer,demo", help="comma-separated: transfer, demo, anchor")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per benchmark process")
    ap.add_argument("--out", default=None, help="write everything as JSON here")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"transfer", "anchor", "demo"}
    if unknown:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (want transfer, anchor, demo)")
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_pair: no CUDA device here (it measures GPU-to-GPU transfers)", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < 2:
        print(
            "bench_gpu_pair: one GPU only: prefill and decode share it (no NVLink; ratios are not the target's)",
            file=sys.stderr,
        )
    out = {
        "what": "cuda-ipc between two processes on two GPUs of one host (scripts/bench_gpu_pair.py)",
        "command": " ".join(sys.argv),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "targets": {"ahead_ratio_at_least": TARGET, "times_mooncake_nvlink_paged": ANCHOR_X},
    }
    runs = {
        "transfer": lambda: transfer_rows("cuda-ipc", args),
        "anchor": lambda: transfer_rows("mooncake", args),
        "demo": lambda: demo_rows(args),
    }
    for part in parts:
        out[part] = runs[part]()
        if args.out:  # after each part: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if report(out, torch.cuda.device_count() > 1) else 1


if __name__ == "__main__":
    sys.exit(main())
