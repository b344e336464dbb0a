#!/usr/bin/env python3
"""The prefix caches, measured on multi-turn chat: for each preset and each user-message
length, one `disagg demo --workload multiturn` (real processes: two stacks of a prefill and a
decode, their prefix caches on in one and off in the other, a router each) runs the same
conversations through both stacks, and this prints per point: decode's and prefill's hit
rates with reuse on, KV bytes moved per request, transfer time, prefill compute and TTFT
(p50), reuse off against on. Shorter user messages against the same shared
system prompt and turns mean more of each prompt is reused.

    # CPU, stand-in engine, Mooncake TCP (about 2 minutes):
    .venv/bin/python scripts/bench_multiturn.py --presets tiny-hybrid --user-lens 512,64 --system-prompt-len 512
    # The recorded CPU figures (docs/bench_multiturn_cpu.json):
    .venv/bin/python scripts/bench_multiturn.py --presets gpt-oss-120b,qwen3-next-80b-a3b \\
        --system-prompt-len 2048 --out docs/bench_multiturn_cpu.json
    # One GPU (prefill and both decodes on it, CUDA IPC), TTFT side by side; a preset a run
    # (each about 5 minutes), long prompts so that Qwen3-Next's 77 MB state is not most of it:
    .venv/bin/python scripts/bench_multiturn.py --device cuda --presets qwen3-next-80b-a3b \\
        --system-prompt-len 16384 --out docs/bench_multiturn_gpu_qwen3_next.json

TTFT here is prefill taking the request -> decode holding its KV (the first token goes out
then); the stand-in's prefill compute is not a model's (--simulate-layer-ms stands for one: the
share of a prompt prefill computes after its cached prefix costs that share of it).
Sends are not streamed layer-wise unless --stream-layers says so: a streamed send's time holds
the compute it overlaps, not only the transfer.
Every request is verified on decode and checked against a colocated run. Exits non-zero when
any request failed.
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
    return f"{platform.processor() or platform.machine()}, CPU, {len(__import__('os').sched_getaffinity(0))} cores"


def demo(preset: str, user_len: int, args) -> tuple[dict, list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "disagg",
        "demo",
        "--workload",
        "multiturn",
        "--preset",
        preset,
        "--device",
        args.device,
        "--transport",
        args.transport,
        "--conversations",
        str(args.conversations),
        "--turns",
        str(args.turns),
        "--system-prompt-len",
        str(args.system_prompt_len),
        "--user-len",
        str(user_len),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--concurrency",
        str(args.concurrency),
        "--stream-layers",
        args.stream_layers,
        "--max-tokens",
        str(pool_tokens(user_len, args)),
        "--max-requests",
        str(args.concurrency + 2),
        "--json",
        "--no-progress",
    ]
    if args.simulate_layer_ms:
        cmd += ["--simulate-layer-ms", str(args.simulate_layer_ms)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]), cmd[1:]
    except (IndexError, ValueError):
        return {"error": (out.stderr or out.stdout)[-2000:], "exit_code": out.returncode}, cmd[1:]


def pool_tokens(user_len: int, args) -> int:
    """Each side's pool: room for the conversations running at once to reach their last turn,
    and one more (decode's cache evicts the conversations that ended, least recently used first;
    the shared system prompt stays in use). A geometry of 72 KiB per token on a CPU needs no
    more: a 64k-token pool would be gigabytes per process."""
    last = args.system_prompt_len + args.turns * (user_len + args.max_new_tokens)
    return args.max_tokens or (args.concurrency + 1) * (last + 64)


def p50(run: dict, key: str) -> float | None:
    return run[key].get("p50")


def row(out: dict) -> dict:
    on, off = out["runs"]["reuse_on"], out["runs"]["reuse_off"]
    return {
        "prompt_tokens_mean": on["prompt_tokens"],
        "hit_rate": on["hit_rate"],
        "prefill_hit_rate": on["prefill_hit_rate"],
        "requests_ok": {"off": off["ok"], "on": on["ok"]},
        "bytes_per_request": {"off": off["bytes_per_request"], "on": on["bytes_per_request"]},
        "bytes_fewer_x": out["reuse_on_vs_off"]["bytes_fewer_x"],
        "transfer_ms_p50": {"off": p50(off, "transfer_ms"), "on": p50(on, "transfer_ms")},
        "compute_ms_p50": {"off": p50(off, "compute_ms"), "on": p50(on, "compute_ms")},
        "ttft_ms_p50": {"off": p50(off, "ttft_ms"), "on": p50(on, "ttft_ms")},
        "per_turn": [
            {
                "turn": t["turn"],
                "prompt_tokens": t["prompt_tokens"],
                "hit_rate": t["hit_rate"],
                "bytes_per_request": {"off": u["bytes_per_request"], "on": t["bytes_per_request"]},
                "transfer_ms_p50": {"off": p50(u, "transfer_ms"), "on": p50(t, "transfer_ms")},
                "prefill_hit_rate": t["prefill_hit_rate"],
                "compute_ms_p50": {"off": p50(u, "compute_ms"), "on": p50(t, "compute_ms")},
                "ttft_ms_p50": {"off": p50(u, "ttft_ms"), "on": p50(t, "ttft_ms")},
            }
            for t, u in zip(on["per_turn"], off["per_turn"], strict=True)
        ],
        "transports": on["transports"],
        "modes": on["modes"],
    }


def say(key: str, r: dict) -> None:
    b, x, t, c = r["bytes_per_request"], r["transfer_ms_p50"], r["ttft_ms_p50"], r["compute_ms_p50"]
    ms = lambda v: "-" if v is None else f"{v:.2f}"  # (None: no request of the run succeeded)
    print(
        f"{key:<34} hit {100 * r['hit_rate']:5.1f}%  MB/request {b['off'] / 1e6:8.2f} -> {b['on'] / 1e6:8.2f} "
        f"({r['bytes_fewer_x']}x fewer)  transfer p50 {ms(x['off'])} -> {ms(x['on'])} ms  "
        f"prefill hit {100 * r['prefill_hit_rate']:5.1f}%  compute p50 {ms(c['off'])} -> {ms(c['on'])} ms  "
        f"TTFT p50 {ms(t['off'])} -> {ms(t['on'])} ms",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="auto", help="mooncake, cuda-ipc, or auto")
    ap.add_argument("--presets", default="gpt-oss-120b", help="comma-separated (`disagg presets`)")
    ap.add_argument(
        "--user-lens",
        default="2048,512,128,32",
        help="comma-separated user message lengths, one point each (shorter: more reuse)",
    )
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1, help="conversations at once (1: latency undisturbed)")
    ap.add_argument("--simulate-layer-ms", type=float, default=0.0, help="stand-in engine: compute per layer")
    ap.add_argument(
        "--stream-layers",
        default="off",
        choices=["on", "off", "auto"],
        help="off (default): a send starts once the KV is computed, so its time is the transfer's alone "
        "(streamed, a send's time holds the compute it overlaps)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="pool capacity per side, in tokens (default: every conversation's last turn, and one more)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per demo")
    ap.add_argument("--out", default=None, help="write the rows as JSON here, with the command, machine and date")
    args = ap.parse_args()
    rows, failed = {}, False
    for preset in args.presets.split(","):
        for user_len in map(int, args.user_lens.split(",")):
            t0 = time.perf_counter()
            out, command = demo(preset, user_len, args)
            key = f"{preset} user {user_len}"
            if "error" in out:
                rows[key] = {"command": " ".join(command), **out}
                print(f"{key}: FAILED {out['error'][-600:]}", flush=True)
                failed = True
                continue
            rows[key] = {
                "user_tokens": user_len,
                **row(out),
                "command": " ".join(command),
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            failures = {label: s["failures"] for label, s in out["runs"].items() if s["failed"]}
            if failures:
                rows[key]["failures"] = failures
                print(f"{key}: failed requests: {json.dumps(failures)[:1500]}", flush=True)
                failed = True
            say(key, rows[key])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "what": "multi-turn chat through the prefix caches (decode's, prefill's): bytes moved per "
                    "request, transfer time, prefill compute and TTFT, reuse off vs on, by hit rate (shorter user "
                    "messages: more reuse)",
                    "command": " ".join(["scripts/bench_multiturn.py", *sys.argv[1:]]),
                    "machine": machine(args.device),
                    "date": datetime.date.today().isoformat(),
                    "workload": {
                        "system_prompt_tokens": args.system_prompt_len,
                        "conversations": args.conversations,
                        "turns": args.turns,
                        "answer_tokens": args.max_new_tokens,
                        "concurrency": args.concurrency,
                    },
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
