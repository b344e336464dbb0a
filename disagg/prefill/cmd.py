"""`disagg prefill`: a prefill worker (pool, transports, model engine, control socket,
bootstrap, HTTP)."""

import argparse

import torch

from disagg.process import setup_logging, wait_for_signal
from disagg.api.fields import abort_route, require_room, require_tokens
from disagg.api.server import ApiServer
from disagg.api.metrics import WorkerMetrics
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.flags import add_pool_flags, announce, http_url, worker_settings

HELP = "run a prefill worker"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_pool_flags(p)
    p.add_argument("--control-port", type=int, default=0, help="control ROUTER port (0: any free port)")
    p.add_argument("--bootstrap-bind", default="tcp://0.0.0.0:8998",
                   help="run the bootstrap server here ('none': use --bootstrap-addr)")
    p.add_argument("--bootstrap-addr", default=None, help="an external bootstrap to register with")
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--transfer-workers", type=int, default=4, help="parallel transfers per decode peer")


def config_from(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(**worker_settings(args), control_port=args.control_port,
                         bootstrap_bind=None if args.bootstrap_bind == "none" else args.bootstrap_bind,
                         bootstrap_addr=args.bootstrap_addr, tp_rank=args.tp_rank, tp_size=args.tp_size,
                         transfer_workers=args.transfer_workers)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    torch.set_num_threads(args.torch_threads)
    server = PrefillServer(config_from(args))
    metrics = WorkerMetrics("prefill")

    def observe(out: dict, ok: bool) -> None:
        if ok:
            metrics.bytes.labels("prefill", out["transport"]).inc(out["bytes"])
            metrics.transfers.labels("prefill", out["mode"], out["transport"]).inc()
            metrics.ranges.labels("prefill").observe(out["ranges"])
            metrics.seconds("transfer", out)
        metrics.seconds("prefill", out)

    def prefill(body: dict) -> dict:
        room, tokens = require_room(body), require_tokens(body)
        return metrics.count(lambda: server.prefill(room, tokens), lambda out: out["state"] == "SUCCESS", observe)

    api = ApiServer(args.http_host or args.host, args.http_port, {"/prefill": prefill, "/abort": abort_route(server.abort)},
                    lambda: server.ready, metrics.registry, lambda: metrics.observe_pool(server.available()),
                    max_inflight=args.max_inflight, health=server.health).start()
    announce(role="prefill", http=http_url(args, api.port), bootstrap=server.bootstrap_endpoint,
             control=server.control_endpoint, transports={t.kind: t.host for t in server.sender.transports})
    wait_for_signal()
    api.stop()
    server.close()
    return 0
