"""`disagg demo`: bootstrap + prefill + decode + router on loopback, a bench workload through
them, a summary; exit code 0 only if every request was verified."""

import argparse
import json

from disagg.engine import registry
from disagg.engine.model.families import FAMILIES
from disagg.tools.bench import add_workload_flags, mismatches, print_summary, run_workload
from disagg.tools.launcher import Launcher

HELP = "start a local prefill/decode pair and router, run a workload, verify every request"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="default: tiny-hybrid, or tiny-model-gpt-oss with --engine model")
    p.add_argument("--engine", default="auto", choices=registry.CHOICES,
                   help="what computes KV: model code (tiny-model-*, model-* presets) or the stand-in (see disagg prefill "
                        "--help); every generation is checked against a colocated run")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=65536, help="pool capacity per side")
    p.add_argument("--transfer-mode", default="auto", choices=["auto", "direct", "staged"])
    p.add_argument("--device", default="cpu", help="pool device: cpu, or cuda (prefill on the first GPU, decode on "
                   "the second where there are two or more)")
    p.add_argument("--transport", default="auto", help="how KV moves between the two (auto: cuda-ipc for CUDA pools "
                   "on one host, else mooncake)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_workload_flags(p)
    p.set_defaults(requests=48, concurrency=4, prompt_len="64:2048", max_new_tokens=8)


def devices(device: str) -> tuple[str, str]:
    """Prefill's and decode's pool device: on CUDA, one GPU each where there are two or more."""
    if device != "cuda":
        return device, device
    import torch
    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def run(args: argparse.Namespace) -> int:
    if args.preset is None:
        args.preset = "tiny-model-gpt-oss" if args.engine == "model" else "tiny-hybrid"
    model = registry.resolve(args.engine, args.preset) == "model"
    pool = ["--preset", args.preset, "--engine", args.engine, "--max-tokens", str(args.max_tokens),
            "--transport", args.transport, "--transfer-mode", args.transfer_mode, "--host", "127.0.0.1"]
    if args.page_size:
        pool += ["--page-size", str(args.page_size)]
    prefill_device, decode_device = devices(args.device)
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *pool, "--device", prefill_device, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *pool, "--device", decode_device, "--bootstrap-addr", prefill["bootstrap"],
                                "--check-rate", "1")
        vocab = ["--vocab-size", str(FAMILIES[args.preset].vocab_size)] if model else []
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}",
                                *vocab)
        if not args.json:
            print(f"prefill {prefill['http']} ({prefill_device})  decode {decode['http']} ({decode_device})  "
                  f"router {router['http']}  preset {args.preset}")
        summary = run_workload(router["http"], args)
    summary["preset"], summary["engine"] = args.preset, registry.resolve(args.engine, args.preset)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    ok = summary["failed"] == 0 and summary["verified"] == summary["requests"] and mismatches(summary) == 0
    return 0 if ok else 1
