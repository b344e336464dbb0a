"""`disagg router`: the HTTP front (POST /generate) over prefill/decode pairs."""

import argparse

from disagg import __version__

from disagg.process import setup_logging, wait_for_signal
from disagg.api.server import ApiServer, client_gone
from disagg.api.metrics import WorkerMetrics
from disagg.router.openai import Completions
from disagg.router.router import Pair, Router, RouterConfig
from disagg.worker.checks import positive_int
from disagg.worker.flags import announce

HELP = "run the router in front of prefill/decode pairs"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", action="append", required=True, type=Pair.parse,
                   help="PREFILL_URL,DECODE_URL,BOOTSTRAP (repeat for more pairs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--max-inflight", type=int, default=256, help="concurrent requests (more: 503 at once)")
    p.add_argument("--vocab-size", type=positive_int, default=50000,
                   help="requests that give prompt_len get random token ids below this (the model's vocabulary)")


def config_from(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(tuple(args.pair), args.host, args.port, args.timeout, max_inflight=args.max_inflight,
                        vocab_size=args.vocab_size)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    router = Router(config_from(args))
    metrics = WorkerMetrics("router")

    def observe(out: dict, ok: bool) -> None:
        if ok:
            metrics.seconds("total", out["timings_ms"], "total")

    def generate(body: dict, on_prefill=None) -> dict:
        return metrics.count(lambda: router.generate(body, client_gone, on_prefill), lambda out: out["ok"], observe)

    routes = {"/generate": generate, "/v1/completions": Completions(generate), "/abort": router.abort}
    api = ApiServer(args.host, args.port, routes, router.ready,
                    metrics.registry, health=lambda: {"status": "ok", "role": "router", "version": __version__,
                                                      "pairs": len(router.config.pairs)}).start()
    announce(role="router", http=f"http://{args.host}:{api.port}")
    wait_for_signal()
    api.stop()
    router.close()
    return 0
