"""`disagg bootstrap`: the standalone bootstrap server (it also runs inside `disagg prefill`)."""

import argparse
import logging
import os

from disagg.process import setup_logging
from disagg.bootstrap.server import BootstrapConfig, BootstrapServer

HELP = "run the bootstrap server that introduces decode workers to prefill ranks"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=os.environ.get("DISAGG_BOOTSTRAP_BIND", "tcp://0.0.0.0:8998"),
                   help="ZMQ endpoint to bind (env DISAGG_BOOTSTRAP_BIND; default tcp://0.0.0.0:8998)")


def config_from(args: argparse.Namespace) -> BootstrapConfig:
    return BootstrapConfig(bind=args.bind)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    server = BootstrapServer(config_from(args))
    logging.getLogger("disagg.bootstrap.server").info("serving on %s", server.endpoint)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
