#!/usr/bin/env python3
"""Layer-wise streaming, measured: for each preset and transport, one `disagg demo` (real
prefill, decode and router processes) runs the same workload twice, streaming off then on
(`--stream-layers both`), and this prints per run: prefill compute time, and the time from
compute end to the KV ready on decode (what streaming hides), side by side.

    # CPU, stand-in engine with a simulated compute time per layer, Mooncake TCP (about 30 s;
    # gpt-oss-120b's geometry moves 72 KiB per token, so a CPU takes a short prompt):
    .venv/bin/python scripts/bench_stream.py --presets gpt-oss-120b --prompt-len 1024 --requests 2 --simulate-layer-ms 5
    # GPU, real model code (random weights), both transports:
    .venv/bin/python scripts/bench_stream.py --device cuda --presets model-gpt-oss-120b,model-qwen3-next-80b \
        --transports cuda-ipc,mooncake --prompt-len 32768 --out docs/bench_stream_gpu.json

Figures per row (p50 over the requests, ms): compute = prefill (KV computed into the pool);
after = prefill compute end -> KV ready on decode; after / compute is what the issue's
"within 5% of compute" target reads; slowdown = streamed compute / unstreamed compute - 1.
Every request is verified on decode (and, with --engine model, checked against a colocated
run). Exits non-zero when any request failed.
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time


def machine(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, CPU"


def demo(preset: str, transport: str, args) -> tuple[dict, str]:
    cmd = [
        sys.executable,
        "-m",
        "disagg",
        "demo",
        "--preset",
        preset,
        "--device",
        args.device,
        "--transport",
        transport,
        "--requests",
        str(args.requests),
        "--concurrency",
        "1",
        "--prompt-len",
        str(args.prompt_len),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--max-tokens",
        str(pool_tokens(args)),
        "--stream-layers",
        "both",
        "--json",
        "--no-progress",
    ]
    if args.simulate_layer_ms:
        cmd += ["--simulate-layer-ms", str(args.simulate_layer_ms)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]), " ".join(cmd[1:])
    except (IndexError, ValueError):
        return {"error": (out.stderr or out.stdout)[-2000:], "exit_code": out.returncode}, " ".join(cmd[1:])


def pool_tokens(args) -> int:
    """Each side's pool: --max-tokens, else room for two requests (one runs at a time; the
    second place is slack). Sized by the workload, not a fixed 64k tokens, which for a large
    geometry is gigabytes a CPU machine need not hold for a short prompt."""
    return args.max_tokens or max(4096, 2 * (args.prompt_len + args.max_new_tokens))


def p50(summary: dict, phase: str) -> float | None:
    return summary.get("latency_ms", {}).get(phase, {}).get("p50")


def row(summaries: dict) -> dict:
    off, on = summaries["stream_off"], summaries["stream_on"]
    r = {
        "requests_ok": [off["requests"] - off["failed"], on["requests"] - on["failed"]],
        "streamed": on.get("streamed", 0),
        "transports": on.get("transports"),
        "modes": on.get("modes"),
        "compute_ms": {"off": p50(off, "prefill"), "on": p50(on, "prefill")},
        "after_compute_ms": {"off": p50(off, "kv_ready_after_compute"), "on": p50(on, "kv_ready_after_compute")},
        "transfer_ms": {"off": p50(off, "transfer"), "on": p50(on, "transfer")},
        "transfer_cpu_ms": {"off": p50(off, "transfer_cpu"), "on": p50(on, "transfer_cpu")},
        "bytes_per_request": off["bytes"] // max(1, off["requests"] - off["failed"]),
    }
    c, a = r["compute_ms"], r["after_compute_ms"]
    if c["on"] and a["on"] is not None and a["off"] is not None:
        r["after_over_compute"] = {"off": round(a["off"] / c["off"], 4), "on": round(a["on"] / c["on"], 4)}
        r["compute_slowdown"] = round(c["on"] / c["off"] - 1, 4)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--presets", default="gpt-oss-120b", help="comma-separated (model-* presets run model code)")
    ap.add_argument("--transports", default="mooncake", help="comma-separated: mooncake, cuda-ipc")
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=4, help="per run (off and on each)")
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--simulate-layer-ms", type=float, default=0.0, help="stand-in engine: compute per layer")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="pool capacity per side, in tokens (default: 2 x (prompt + new tokens), at least 4096)",
    )
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per demo")
    ap.add_argument("--out", default=None, help="write the rows as JSON here, with the command, machine and date")
    args = ap.parse_args()
    rows, failed = {}, False
    for preset in args.presets.split(","):
        for transport in args.transports.split(","):
            t0 = time.perf_counter()
            summaries, command = demo(preset, transport, args)
            key = f"{preset} {transport}"
            if "error" in summaries or "stream_on" not in summaries:
                rows[key] = {"command": command, **summaries}
                print(f"{key}: FAILED {str(summaries.get('error', summaries))[-600:]}", flush=True)
                failed = True
                continue
            rows[key] = {**row(summaries), "command": command, "wall_s": round(time.perf_counter() - t0, 1)}
            r = rows[key]
            failures = {label: s["failures"] for label, s in summaries.items() if s["failed"]}
            if failures:
                rows[key]["failures"] = failures
                print(f"{key}: failed requests: {json.dumps(failures)[:1500]}", flush=True)
                failed = True
                continue
            print(
                f"{key:<34} compute {r['compute_ms']['off']:.1f} / {r['compute_ms']['on']:.1f} ms (off/on)  "
                f"KV ready after compute: {r['after_compute_ms']['off']:.1f} ms off, {r['after_compute_ms']['on']:.1f} "
                f"ms on  (x compute {r.get('after_over_compute')}, slowdown {r.get('compute_slowdown')})  "
                f"{r['bytes_per_request'] / 1e6:.0f} MB/request, sender CPU {r['transfer_cpu_ms']}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "what": "layer-wise streaming: prefill compute and KV ready after compute, streaming off vs on",
                    "command": " ".join(sys.argv),
                    "machine": machine(args.device),
                    "date": datetime.date.today().isoformat(),
                    "prompt_tokens": args.prompt_len,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
