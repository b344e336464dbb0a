"""`disagg router`: the HTTP front (POST /generate) over prefill/decode pairs; with
`--backend vllm`, over vLLM api_servers with DisaggConnector (disagg/router/vllm.py)."""

import argparse

from disagg.process import add_process_flags
from disagg.router.router import Pair, RouterConfig
from disagg.checks import port, positive_int, seconds, weight
from disagg.worker.flags import add_http_limit_flags, announce, http_limits

HELP = "run the router in front of prefill/decode pairs"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pair",
        action="append",
        default=[],
        type=Pair.parse,
        metavar="PREFILL_URL[+URL...],DECODE_URL[+URL...],BOOTSTRAP",
        help="one prefill/decode pair: the two workers' HTTP URLs and the bootstrap decode should look "
        "prefill up at (a NAME decode was given with --bootstrap-addr, or tcp://HOST:PORT); a "
        "tensor-parallel instance is its ranks' URLs joined by + in rank order (every rank takes "
        "part in every request); repeat for more pairs (env: pairs separated by spaces); with "
        "--backend vllm: PREFILL_URL,DECODE_URL of two vLLM api_servers",
    )
    p.add_argument(
        "--pairs-file",
        metavar="FILE",
        help="more pairs, one --pair value per line (# comments), read again whenever the file changes: "
        "pairs added are probed and then served, pairs taken out get no new request, without a "
        "restart (a file that does not parse is logged and the pairs stay as they were)",
    )
    g = p.add_argument_group("routing")
    g.add_argument(
        "--route",
        choices=("kv", "round-robin"),
        default="kv",
        help="kv: each request to the pair whose decode (and prefill, where it caches) holds the longest "
        "prefix of its prompt, weighed against load (every worker's cache is read from its "
        "/cache/events); round-robin: pairs in turn",
    )
    g.add_argument(
        "--kv-load-weight",
        type=weight,
        default=1.0,
        metavar="W",
        help="--route kv: a pair's cost is the prompt tokens it lacks plus W x the tokens in flight on "
        "it (and what its decode lacks of free pages): 0 routes by reuse alone, a large W by load",
    )
    p.add_argument(
        "--backend",
        choices=("disagg", "vllm"),
        default="disagg",
        help="what the pairs are: disagg's prefill/decode workers, or vLLM api_servers with "
        "DisaggConnector (a kv_producer and a kv_consumer: /v1/completions and /v1/chat/completions "
        "go through them as vLLM's P/D proxy sends them)",
    )
    g = p.add_argument_group("HTTP")
    g.add_argument("--http-host", default="127.0.0.1", help="address to serve the API on (0.0.0.0: every address)")
    g.add_argument(
        "--http-port", type=port, default=0, help="port to serve the API on (0: any free port, printed when ready)"
    )
    g.add_argument("--host", dest="http_host", help=argparse.SUPPRESS)  # former names
    g.add_argument("--port", dest="http_port", type=port, help=argparse.SUPPRESS)
    add_http_limit_flags(g)
    g = p.add_argument_group("requests")
    g.add_argument("--timeout", type=seconds, default=60.0, help="seconds one request may take end to end (504 after)")
    g.add_argument(
        "--max-inflight", type=positive_int, default=256, help="requests in flight at once (more: 503 with Retry-After)"
    )
    g.add_argument(
        "--vocab-size",
        type=positive_int,
        default=50000,
        help="requests that give prompt_len get random token ids below this (the model's vocabulary)",
    )
    g.add_argument(
        "--served-model-name",
        default="disagg",
        metavar="NAME",
        help="the model name GET /v1/models lists and /v1/completions answers with",
    )
    add_process_flags(p)


def config_from(args: argparse.Namespace) -> RouterConfig:
    """The router's config; ConfigError (one line, nothing started) for pairs the backend cannot take."""
    from disagg.errors import ConfigError
    from disagg.router.vllm import check_pairs

    from disagg.router.roster import read_pairs

    pairs = tuple(args.pair)
    why = (
        check_pairs(pairs)
        if args.backend == "vllm"
        else next(
            (
                f"--pair {p}: give the bootstrap decode looks prefill up at (PREFILL_URL,DECODE_URL,BOOTSTRAP)"
                for p in pairs
                if not p.bootstrap
            ),
            None,
        )
    )
    if not pairs and args.pairs_file is None:
        why = "give at least one --pair, or --pairs-file"
    elif args.pairs_file is not None and args.backend == "vllm":
        why = "--pairs-file is for --backend disagg (vLLM pairs are given with --pair)"
    elif args.pairs_file is not None:
        try:
            read_pairs(args.pairs_file)  # read once now: a missing or wrong file stops the start
        except (OSError, ValueError) as exc:
            why = f"--pairs-file: {exc}"
    if why:
        raise ConfigError(why)
    return RouterConfig(
        pairs,
        args.http_host,
        args.http_port,
        args.timeout,
        max_inflight=args.max_inflight,
        vocab_size=args.vocab_size,
        model_name=args.served_model_name,
        route=args.route,
        kv_load_weight=args.kv_load_weight,
        pairs_file=args.pairs_file,
    )


def run(args: argparse.Namespace) -> int:
    from disagg.api.server import ApiServer, listen
    from disagg.process import serve_api, setup_logging
    from disagg.router.router import Router
    from disagg.router.routes import RouterRoutes

    setup_logging(args.log_level)
    config = config_from(args)
    listener = listen(args.http_host, args.http_port)
    if args.backend == "vllm":
        from disagg.router.routes import VllmRoutes
        from disagg.router.vllm import VllmRouter

        router = VllmRouter(config)
        api = ApiServer(listener, VllmRoutes(router).service(), http_limits(args))
    else:
        router = Router(config)
        api = ApiServer(listener, RouterRoutes(router).service(), http_limits(args))

    def ready_line() -> None:  # the router serves (503 with the reasons) while its pairs are down
        state = router.ready()
        down = None if state["ready"] else "; ".join(f"pair {p['pair']}: {', '.join(p['why'])}" for p in state["pairs"])
        announce(
            role="router",
            http=f"http://{args.http_host}:{api.port}",
            not_ready=down,
            pairs=len(state["pairs"]),
            pairs_up=state["pairs_up"],
        )

    serve_api(api, lambda: {"ready": True}, ready_line, router.close)
    return 0
