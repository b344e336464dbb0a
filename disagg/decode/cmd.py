"""`disagg decode`: a decode worker (pool, transports, model engine, control sockets to
prefill peers, HTTP)."""

import argparse
from typing import TYPE_CHECKING

from disagg.api.fields import named_endpoint
from disagg.checks import positive_int, seconds, share
from disagg.worker.flags import add_pool_flags, announce, http_limits, http_url, worker_settings

if TYPE_CHECKING:
    from disagg.decode.server import DecodeConfig

HELP = "run a decode worker"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_pool_flags(p)
    g = p.add_argument_group("decode")
    g.add_argument(
        "--bootstrap-addr",
        action="append",
        type=named_endpoint,
        metavar="[NAME=]tcp://HOST:PORT",
        help="a bootstrap this decode may look prefill up at (repeat for more; the first is the "
        "default, also named 'default'; requests name one by NAME or by its address, never "
        "another; default tcp://127.0.0.1:8998; env: several separated by spaces)",
    )
    g.add_argument(
        "--slots-per-transfer",
        type=positive_int,
        default=2,
        help="staging slots lent to one sender of a request at most (one per chunk it has); every "
        "sender that moves by token gets one, the request waiting for them if need be",
    )
    g.add_argument(
        "--scatter-workers",
        type=positive_int,
        default=4,
        help="threads that copy staged chunks from the staging slots into the pool, off the control "
        "loop (the senders of a resharded request scatter side by side; copies release the GIL)",
    )
    g.add_argument("--heartbeat-interval", type=seconds, default=1.0, help="seconds between heartbeats to prefill")
    g.add_argument(
        "--check-rate",
        type=share,
        default=0.0,
        metavar="SHARE",
        help="share of requests (0..1) whose generation decode compares, token for token and logit "
        "for logit, with the same prompt run colocated (costs one more prefill and decode); one that "
        "differs fails the request (HTTP 500 at the router)",
    )
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the whole pages of finished requests (prompt and generated tokens) in a radix tree "
        "and reuse the longest cached prefix of a new prompt: prefill then sends only the rest; "
        "unused cached pages are evicted (least recently used) whenever a request needs room; "
        "the engine says what of a request it may keep (the model engine: the prompt's whole "
        "prefill chunks), or that none is exact (then it is off; the log says why)",
    )
    g.add_argument(
        "--quarantine",
        type=seconds,
        default=60.0,
        help="longest hold, in seconds, of a failed request's pages while prefill may still write",
    )


def config_from(args: argparse.Namespace) -> "DecodeConfig":
    from disagg.decode.server import DecodeConfig

    entries = args.bootstrap_addr or [("", "tcp://127.0.0.1:8998")]
    return DecodeConfig(
        **worker_settings(args),
        bootstrap_addr=entries[0][1],
        bootstraps=tuple((name or endpoint, endpoint) for name, endpoint in entries),
        slots_per_transfer=args.slots_per_transfer,
        scatter_workers=args.scatter_workers,
        heartbeat_interval_s=args.heartbeat_interval,
        quarantine_s=args.quarantine,
        check_rate=args.check_rate,
        prefix_cache=args.prefix_cache,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from disagg.api.server import ApiServer, listen
    from disagg.decode.routes import DecodeRoutes
    from disagg.decode.server import DecodeServer
    from disagg.process import serve_api, setup_logging

    setup_logging(args.log_level)
    listener = listen(args.http_host or args.host, args.http_port)
    torch.set_num_threads(args.torch_threads)
    server = DecodeServer(config_from(args))
    api = ApiServer(listener, DecodeRoutes(server).service(), http_limits(args))
    serve_api(
        api,
        server.readiness,
        lambda: announce(
            role="decode",
            http=http_url(args, api.port),
            pool=server.pool_summary,
            transports={t.kind: t.host for t in server.endpoint.transports},
            bootstrap=server.config.bootstrap_addr,
        ),
        server.close,
    )
    return 0
