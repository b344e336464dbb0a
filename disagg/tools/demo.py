"""`disagg demo`: bootstrap + prefill + decode + router on loopback, a bench workload through
them, a summary; exit code 0 only if every request was verified. Ctrl-C, SIGTERM or a failure
stops every process it started (tools/launcher.py)."""

import argparse
import json
import sys

from disagg.engine import registry
from disagg.engine.model.families import FAMILIES
from disagg.tools.bench import add_workload_flags, mismatches, one_json, print_summaries, run_multiturn, run_workloads
from disagg.tools.multiturn import all_served, print_table
from disagg.checks import positive_int, power_of_two
from disagg.worker.flags import add_model_flags, model_source
from kvpool.layout import Layout
from kvpool.presets import PRESETS
from transfer.config import Mode
from transfer.transports import TRANSPORTS

HELP = "start a local prefill/decode pair and router, run a workload, verify every request"


def add_parser(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the pair")
    g.add_argument(
        "--preset",
        default=None,
        choices=[*PRESETS, *FAMILIES],
        metavar="PRESET",
        help="model geometry, one of `disagg presets` or a model family (tiny-model-*, model-*); "
        "default: tiny-hybrid, or tiny-model-gpt-oss with --engine model",
    )
    g.add_argument(
        "--engine",
        default="auto",
        choices=registry.CHOICES,
        help="what computes KV: model code (tiny-model-*, model-* presets) or the stand-in (see disagg "
        "prefill --help); every model generation is checked against a colocated run",
    )
    add_model_flags(g)
    g.add_argument("--page-size", type=power_of_two, default=None, help="tokens per page (default: the preset's)")
    g.add_argument(
        "--prefill-page-size",
        type=power_of_two,
        default=None,
        metavar="N",
        help="prefill's tokens per page, where the two sides differ (default: --page-size); the KV then moves by token",
    )
    g.add_argument(
        "--decode-page-size",
        type=power_of_two,
        default=None,
        metavar="N",
        help="decode's tokens per page (default: --page-size)",
    )
    g.add_argument(
        "--prefill-tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks of the prefill instance (one process each)",
    )
    g.add_argument(
        "--decode-tp",
        type=positive_int,
        default=1,
        metavar="M",
        help="tensor-parallel ranks of the decode instance; where N != M each decode rank receives its "
        "heads from the prefill ranks that hold them",
    )
    g.add_argument("--max-tokens", type=positive_int, default=65536, help="pool capacity per side, in tokens")
    g.add_argument(
        "--max-requests",
        type=positive_int,
        default=64,
        help="request slots per side (each holds a Mamba/GDN state and an AUX row; fewer use less memory)",
    )
    g.add_argument("--layout", default="page_major", choices=[l.value for l in Layout], help="buffer layout")
    g.add_argument(
        "--transfer-mode",
        default="auto",
        choices=[m.value for m in Mode],
        help="direct, staged, gathered, or auto (chosen per request)",
    )
    g.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="pool device: cpu, or cuda (prefill on the first GPU, decode on the second where there are two or more)",
    )
    g.add_argument(
        "--transport",
        default="auto",
        choices=TRANSPORTS.choices(),
        help="how KV moves between the two (auto: cuda-ipc for CUDA pools on one host, else mooncake)",
    )
    g.add_argument(
        "--simulate-layer-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="stand-in engine: simulated prefill compute per layer, to watch --stream-layers hide the "
        "transfer (0: none)",
    )
    g.add_argument(
        "--worker-logs",
        action="store_true",
        help="pass the workers' and router's logs through to stderr (else shown only if one fails)",
    )
    g = p.add_argument_group("workload and output")
    add_workload_flags(g)
    g.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(requests=48, concurrency=4, prompt_len="64:2048", max_new_tokens=8)


def devices(device: str) -> tuple[str, str]:
    """Prefill's and decode's pool device: on CUDA, one GPU each where there are two or more."""
    if device != "cuda":
        return device, device
    import torch

    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def urls(ranks: list[dict]) -> str:
    """An instance as the router's --pair takes it: its ranks' URLs joined by +."""
    return "+".join(r["http"] for r in ranks)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # progress: stderr, so --json keeps stdout


def start_prefill(launcher, args: argparse.Namespace, flags: list[str], cache: list[str], what: str) -> list[dict]:
    """A prefill instance of `flags` and `cache` (its prefix-cache flag, or none: the default)
    with a bootstrap of its own: its ranks."""
    say(f"starting prefill ({what}, TP {args.prefill_tp}{''.join(', ' + c.lstrip('-') for c in cache)}) ...")
    prefill = launcher.start_instance(
        "prefill", args.prefill_tp, *flags, *cache, "--bootstrap-bind", "tcp://127.0.0.1:*"
    )
    say(
        f"  prefill ready in {sum(r['started_s'] for r in prefill):.1f} s on {urls(prefill)}, pool "
        f"{prefill[0]['pool']['human']} per rank"
    )
    return prefill


def decode_and_router(
    launcher, args: argparse.Namespace, prefill: list[dict], flags: list[str], device: str, cache: list[str]
) -> str:
    """A decode instance of `flags` and `cache` (its prefix-cache flag, or none: the default)
    registered with `prefill`, and a router of that one pair: its URL. (prompt_len ids are drawn
    below the vocabulary the workers report in /health.)"""
    say(f"starting decode ({device}, TP {args.decode_tp}{''.join(', ' + c.lstrip('-') for c in cache)}) ...")
    decode = launcher.start_instance(
        "decode",
        args.decode_tp,
        *flags,
        *cache,
        "--device",
        device,
        "--bootstrap-addr",
        prefill[0]["bootstrap"],
        "--check-rate",
        "1",
    )
    say(
        f"  decode ready in {sum(r['started_s'] for r in decode):.1f} s on {urls(decode)}, pool "
        f"{decode[0]['pool']['human']} per rank"
    )
    router = launcher.start("router", "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}")
    say(f"  router ready on {router['http']}")
    return router["http"]


def _multiturn(routers: list[str], args: argparse.Namespace, name: str, engine: str) -> int:
    """The multi-turn workload through both stacks (prefix cache on, then off), side by side."""
    say(f"{args.conversations} conversations of {args.turns} turns, {args.concurrency} at a time, through each")
    out = run_multiturn(routers, args)
    out["workload"].update(preset=name, engine=engine, tp=f"{args.prefill_tp}:{args.decode_tp}")
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0 if all_served(out) else 1


def run(args: argparse.Namespace) -> int:
    from disagg.tools.launcher import Launcher

    source = model_source(args)
    if args.preset is None:
        args.preset = "tiny-model-gpt-oss" if args.engine == "model" else "tiny-hybrid"
    engine = registry.resolve(args.engine, args.preset, source)
    models = [
        f"--{flag.replace('_', '-')}={getattr(args, flag)}"
        for flag in ("model", "model_type", "model_config")
        if getattr(args, flag) is not None
    ] + ["--dtype", args.dtype]
    name = source.name if source is not None else args.preset
    pool = [
        "--preset",
        args.preset,
        *models,
        "--engine",
        args.engine,
        "--max-tokens",
        str(args.max_tokens),
        "--max-requests",
        str(args.max_requests),
        "--layout",
        args.layout,
        "--transport",
        args.transport,
        "--transfer-mode",
        args.transfer_mode,
        "--host",
        "127.0.0.1",
    ]
    pages = {
        side: (["--page-size", str(n)] if n else [])
        for side, n in (
            ("prefill", args.prefill_page_size or args.page_size),
            ("decode", args.decode_page_size or args.page_size),
        )
    }
    prefill_device, decode_device = devices(args.device)
    prefill_flags = [*pool, *pages["prefill"], "--device", prefill_device]
    if args.simulate_layer_ms:
        prefill_flags += ["--simulate-layer-ms", str(args.simulate_layer_ms)]
    with Launcher(logs=args.worker_logs) as launcher:
        # multiturn: two stacks, both prefix caches on and both off, each behind its router
        caches = [["--prefix-cache"], ["--no-prefix-cache"]] if args.workload == "multiturn" else [[]]
        routers = []
        for cache in caches:
            prefill = start_prefill(launcher, args, prefill_flags, cache, f"{name}, engine {engine}, {prefill_device}")
            routers.append(decode_and_router(launcher, args, prefill, [*pool, *pages["decode"]], decode_device, cache))
        if args.workload == "multiturn":
            return _multiturn(routers, args, name, engine)
        say(f"{args.requests} requests, {args.concurrency} at a time, prompts of {args.prompt_len} tokens")
        summaries = run_workloads(routers[0], args)
    for summary in summaries.values():
        summary["preset"], summary["engine"] = name, engine
        summary["tp"] = f"{args.prefill_tp}:{args.decode_tp}"
    if args.json:
        print(json.dumps(one_json(summaries)))
    else:
        print_summaries(summaries)
    ok = all(s["failed"] == 0 and s["verified"] == s["requests"] and mismatches(s) == 0 for s in summaries.values())
    return 0 if ok else 1
