"""`disagg prefill`: a prefill worker (pool, transports, model engine, control socket,
bootstrap, HTTP)."""

import argparse
import dataclasses
from typing import TYPE_CHECKING

from disagg.api.fields import STREAM_LAYERS
from disagg.checks import port, milliseconds, positive_int
from disagg.worker.flags import add_pool_flags, announce, http_limits, http_url, worker_settings

if TYPE_CHECKING:
    from disagg.prefill.server import PrefillConfig

HELP = "run a prefill worker"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_pool_flags(p)
    g = p.add_argument_group("prefill")
    g.add_argument(
        "--control-port",
        type=port,
        default=0,
        help="port of the control socket decode workers "
        "connect to (0: any free port; the bootstrap tells decode which)",
    )
    g.add_argument(
        "--bootstrap-bind",
        default=None,
        metavar="tcp://HOST:PORT|none",
        help="run the bootstrap server inside this process, here (default: port 8998 on --host, the "
        "address the other listeners use); none: register with --bootstrap-addr instead (a second "
        "prefill on one host needs one of the two)",
    )
    g.add_argument(
        "--bootstrap-addr",
        default=None,
        metavar="tcp://HOST:PORT",
        help="an external bootstrap (`disagg bootstrap`) to register with",
    )
    g.add_argument("--transfer-workers", type=positive_int, default=4, help="parallel transfers per decode peer")
    g.add_argument(
        "--stream-layers",
        default="auto",
        choices=STREAM_LAYERS,
        help="send a request's KV in layer groups while the model engine still computes the later "
        "layers (on), only once it is done (off), or (auto) for prompts of at least "
        "--stream-min-tokens over a link that does not slow the compute (not Mooncake TCP "
        "from a CUDA pool); a request's stream_layers field overrides it",
    )
    g.add_argument(
        "--stream-min-tokens",
        type=positive_int,
        default=2048,
        help="--stream-layers auto streams prompts at least this long",
    )
    g.add_argument(
        "--stream-group-ms",
        type=milliseconds,
        default=2.0,
        metavar="MS",
        help="a streamed layer group is at least this much link time (fewer, larger writes above; "
        "more of the transfer hidden behind compute below)",
    )
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the whole pages of computed prompts in a radix tree and compute only what follows "
        "the longest cached prefix of a new prompt; unused cached pages are evicted (least "
        "recently used) whenever a request needs room; where the engine cannot resume a prompt "
        "with the same bits (the model engine: one pass, state layers, a TP shard) it is off and "
        "the log says why",
    )
    g.add_argument(
        "--simulate-layer-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="stand-in engine only: compute time to simulate per layer of a whole prompt in prefill "
        "(a prompt resumed after a cached prefix: the share it computes), so benchmarks and "
        "tests can watch layer-wise streaming hide the transfer (0: none)",
    )


def bootstrap_bind(args: argparse.Namespace) -> str | None:
    """Where the bootstrap inside this prefill listens: --bootstrap-bind, by default port 8998 on
    --host (every listener on the host the operator chose); None: none runs here."""
    if args.bootstrap_bind == "none":
        return None
    return args.bootstrap_bind or f"tcp://{args.host}:8998"


def config_from(args: argparse.Namespace) -> "PrefillConfig":
    from disagg.prefill.server import PrefillConfig

    settings = worker_settings(args)
    settings["transfer"] = dataclasses.replace(settings["transfer"], stream_group_ms=args.stream_group_ms)
    settings["simulate_layer_ms"] = args.simulate_layer_ms
    return PrefillConfig(
        **settings,
        control_port=args.control_port,
        bootstrap_bind=bootstrap_bind(args),
        bootstrap_addr=args.bootstrap_addr,
        transfer_workers=args.transfer_workers,
        stream_layers=args.stream_layers,
        stream_min_tokens=args.stream_min_tokens,
        prefix_cache=args.prefix_cache,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from disagg.api.server import ApiServer, listen
    from disagg.prefill.routes import PrefillRoutes
    from disagg.prefill.server import PrefillServer
    from disagg.process import serve_api, setup_logging

    setup_logging(args.log_level)
    listener = listen(args.http_host or args.host, args.http_port)
    torch.set_num_threads(args.torch_threads)
    server = PrefillServer(config_from(args))
    api = ApiServer(listener, PrefillRoutes(server).service(), http_limits(args))
    serve_api(
        api,
        server.readiness,
        lambda: announce(
            role="prefill",
            http=http_url(args, api.port),
            pool=server.pool_summary,
            bootstrap=server.bootstrap_endpoint,
            control=server.control_endpoint,
            transports={t.kind: t.host for t in server.endpoint.transports},
        ),
        server.close,
    )
    return 0
