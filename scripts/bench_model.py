#!/usr/bin/env python3
"""Real model code through a disagg pair, per family: `disagg demo --engine model` (real
prefill, decode and router processes; every request checked against a colocated run) and
the time split of one request: prefill (model compute, KV written into the pool layer by
layer), transfer, cache rebuild on decode, decode steps, the colocated check.

    .venv/bin/python scripts/bench_model.py [--device cuda] [--presets tiny-model-gpt-oss,...]
        [--requests 8] [--prompt-len 1:200] [--max-new-tokens 8] [--out FILE.json]

Every tiny-model-* family runs by default: the attention families, the GDN and Mamba hybrids
(qwen3-next, nemotron-h, jamba, bamba, granite-hybrid), falcon-h1 (K/V and a Mamba2 state in
one layer) and the MLA ones. Prints one line per family; --out writes every demo summary with the command, the machine and
the date. Exits non-zero when any request failed or differed from the colocated run.
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time

SPLIT = ("prefill", "transfer", "rebuild", "decode", "check", "total")


def machine(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, CPU"


def run_one(preset: str, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "disagg",
        "demo",
        "--engine",
        "model",
        "--preset",
        preset,
        "--device",
        args.device,
        "--requests",
        str(args.requests),
        "--concurrency",
        str(args.concurrency),
        "--prompt-len",
        args.prompt_len,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--json",
        "--no-progress",
    ]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        return {
            "error": f"no summary within {args.timeout:g} s; stderr: "
            f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}",
            "command": " ".join(cmd[1:]),
            "exit_code": None,
        }
    lines = out.stdout.strip().splitlines()
    try:
        summary = json.loads(lines[-1])
    except (IndexError, ValueError):
        summary = {"error": (out.stderr or out.stdout)[-1500:]}
    summary["wall_s_with_start"] = round(time.perf_counter() - t0, 1)
    summary["command"] = " ".join(cmd[1:])
    summary["exit_code"] = out.returncode
    return summary


def engine_only(preset: str, args) -> dict:
    """In this process, no transfer: build the model, prefill one prompt of --prompt-len (its
    MAX) tokens into a pool on --device, decode from that pool, check; synchronized timings."""
    import numpy as np
    import torch

    from disagg.engine import registry
    from kvpool import HybridPool, PoolConfig

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    n = int(args.prompt_len.split(":")[-1])
    t0 = time.perf_counter()
    eng = registry.create("model", preset, args.device)
    build_s = time.perf_counter() - t0
    pool = HybridPool(
        PoolConfig(
            eng.spec,
            eng.spec.default_page_size,
            max_tokens=4 * (n + args.max_new_tokens + 64),
            max_requests=2,
            device=args.device,
        )
    )
    tokens = np.random.default_rng(0).integers(0, eng.vocab_size, n)
    rows = []
    for _ in range(args.requests):
        req = pool.alloc_request(n)
        layers = []
        sync()
        t = time.perf_counter()
        eng.prefill(pool, req, tokens, 1, on_layer=lambda i: layers.append(time.perf_counter()))
        sync()
        prefill_ms = (time.perf_counter() - t) * 1e3
        out = eng.decode(pool, req, tokens, args.max_new_tokens)
        t = time.perf_counter()
        check = eng.check(tokens, out)
        rows.append(
            {
                "prefill_ms": round(prefill_ms, 2),
                **{f"{k}_ms": round(v, 2) for k, v in out.timings_ms.items()},
                "check_ms": round((time.perf_counter() - t) * 1e3, 2),
                "token_match": check["token_match"],
                "logits_match": check["logits_match"],
                "layers_reported": len(layers),
            }
        )
        pool.free_request(req)
    return {"prompt_tokens": n, "max_new_tokens": args.max_new_tokens, "build_s": round(build_s, 1), "runs": rows}


def line(preset: str, s: dict) -> str:
    if "runs" in s:
        r = s["runs"][-1]
        return (
            f"{preset:26s} engine only, {s['prompt_tokens']} tokens: build {s['build_s']} s  prefill "
            f"{r['prefill_ms']} ms  rebuild {r.get('rebuild_ms')} ms  {s['max_new_tokens']} steps "
            f"{r.get('steps_ms')} ms  token_match {all(x['token_match'] for x in s['runs'])}  "
            f"logits {all(x['logits_match'] for x in s['runs'])}"
        )
    if "latency_ms" not in s:
        return f"{preset:26s} FAILED: {s.get('error', '')[-300:]}"
    m, lat = s.get("token_match", {}), s["latency_ms"]
    split = "  ".join(f"{k} {lat[k]['p50']:.1f}" for k in SPLIT if k in lat)
    return (
        f"{preset:26s} {s['requests'] - s['failed']}/{s['requests']} ok  token_match {m.get('match')}/"
        f"{m.get('checked')}  logits {m.get('logits_match')}/{m.get('checked')}  "
        f"shard {m.get('shard_match', m.get('match'))}/{m.get('checked')}  "
        f"{','.join(s.get('transports', {}))}  p50 ms: {split}"
    )


def main() -> int:
    from disagg.engine.model.families import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--presets",
        default=",".join(f for f in FAMILIES if f.startswith("tiny-")),
        help=f"comma-separated, of: {', '.join(FAMILIES)}",
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", default="1:200", help="N or MIN:MAX tokens")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds per family")
    p.add_argument("--out", help="write every summary here as JSON")
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="no processes, no transfer: the model's own compute times in this process",
    )
    args = p.parse_args()
    results, bad = {}, False
    for preset in args.presets.split(","):
        if preset not in FAMILIES:
            p.error(f"unknown preset {preset!r}; choose from {', '.join(FAMILIES)}")
        if args.engine_only:
            results[preset] = s = engine_only(preset, args)
            bad |= not all(r["token_match"] for r in s["runs"])
        else:
            results[preset] = s = run_one(preset, args)
            m = s.get("token_match", {})
            bad |= s.get("exit_code") != 0 or s.get("failed", 1) > 0 or m.get("match") != m.get("checked")
        print(line(preset, s), flush=True)
        if args.out:  # after every family: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "command": " ".join(sys.argv),
                        "machine": machine(args.device),
                        "date": datetime.date.today().isoformat(),
                        "results": results,
                    },
                    f,
                    indent=1,
                )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
