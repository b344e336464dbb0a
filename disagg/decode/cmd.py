"""`disagg decode`: a decode worker (pool, transports, model engine, control sockets to
prefill peers, HTTP)."""

import argparse
from typing import TYPE_CHECKING

from disagg.api.fields import named_endpoint
from disagg.worker.checks import positive_int, seconds, share
from disagg.worker.flags import add_pool_flags, announce, http_url, worker_settings

if TYPE_CHECKING:
    from disagg.decode.server import DecodeConfig

HELP = "run a decode worker"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_pool_flags(p)
    g = p.add_argument_group("decode")
    g.add_argument("--bootstrap-addr", action="append", type=named_endpoint, metavar="[NAME=]tcp://HOST:PORT",
                   help="a bootstrap this decode may look prefill up at (repeat for more; the first is the "
                        "default, also named 'default'; requests name one by NAME or by its address, never "
                        "another; default tcp://127.0.0.1:8998; env: several separated by spaces)")
    g.add_argument("--slots-per-transfer", type=positive_int, default=2, help="staging slots lent to one transfer")
    g.add_argument("--heartbeat-interval", type=seconds, default=1.0, help="seconds between heartbeats to prefill")
    g.add_argument("--check-rate", type=share, default=0.0, metavar="SHARE",
                   help="share of requests (0..1) whose generation decode compares, token for token and logit "
                        "for logit, with the same prompt run colocated (costs one more prefill and decode)")
    g.add_argument("--quarantine", type=seconds, default=60.0,
                   help="longest hold, in seconds, of a failed request's pages while prefill may still write")


def config_from(args: argparse.Namespace) -> "DecodeConfig":
    from disagg.decode.server import DecodeConfig
    entries = args.bootstrap_addr or [("", "tcp://127.0.0.1:8998")]
    return DecodeConfig(**worker_settings(args), bootstrap_addr=entries[0][1],
                        bootstraps=tuple((name or endpoint, endpoint) for name, endpoint in entries),
                        slots_per_transfer=args.slots_per_transfer, heartbeat_interval_s=args.heartbeat_interval,
                        quarantine_s=args.quarantine, check_rate=args.check_rate)


def run(args: argparse.Namespace) -> int:
    import torch

    from disagg.api.fields import abort_route, optional_int, require_room, require_tokens
    from disagg.api.metrics import WorkerMetrics
    from disagg.api.server import ApiServer
    from disagg.decode.server import DecodeServer
    from disagg.errors import BadRequest
    from disagg.process import serve, setup_logging

    setup_logging(args.log_level)
    torch.set_num_threads(args.torch_threads)
    server = DecodeServer(config_from(args))
    metrics = WorkerMetrics("decode")

    def observe(out: dict, ok: bool) -> None:
        if ok:
            metrics.bytes.labels("decode", out["transport"]).inc(out["bytes"])
            for phase in ("bootstrap", "wait", "verify", "decode", "check"):
                metrics.seconds(phase, out)

    def decode(body: dict) -> dict:
        room, tokens = require_room(body), require_tokens(body)
        max_new = optional_int(body, "max_new_tokens", 1, 1, 4096)
        bootstrap = body.get("bootstrap")
        if bootstrap is not None and not (isinstance(bootstrap, str) and 0 < len(bootstrap) <= 256):
            raise BadRequest("bootstrap must be the name or address of a bootstrap this decode is configured with")
        return metrics.count(lambda: server.decode(room, tokens, max_new, bootstrap),
                             lambda out: out["state"] == "SUCCESS", observe)

    api = ApiServer(args.http_host or args.host, args.http_port, {"/decode": decode, "/abort": abort_route(server.abort)},
                    server.readiness, metrics.registry,
                    lambda: metrics.observe_pool(server.pool.available()), max_inflight=args.max_inflight,
                    health=server.health).start()
    serve(server.readiness, lambda: announce(role="decode", http=http_url(args, api.port), pool=server.pool_summary,
                                             transports={t.kind: t.host for t in server.receiver.transports},
                                             bootstrap=server.config.bootstrap_addr))
    api.stop()
    server.close()
    return 0
