"""`disagg bootstrap`: the standalone bootstrap server (it also runs inside `disagg prefill`)."""

import argparse
import logging
import os

import zmq

from disagg.bootstrap.server import BootstrapConfig, BootstrapServer
from disagg.control.auth import Gate, add_auth_flags, key_of
from disagg.process import setup_logging

HELP = "run the bootstrap server that introduces decode workers to prefill ranks"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=os.environ.get("DISAGG_BOOTSTRAP_BIND", "tcp://0.0.0.0:8998"),
                   help="ZMQ endpoint to bind (env DISAGG_BOOTSTRAP_BIND; default tcp://0.0.0.0:8998)")
    add_auth_flags(p)


def config_from(args: argparse.Namespace) -> BootstrapConfig:
    return BootstrapConfig(bind=args.bind)


def run(args: argparse.Namespace) -> int:
    setup_logging()
    gate = Gate(zmq.Context.instance(), key_of(args), "bootstrap")
    server = BootstrapServer(config_from(args), gate)
    logging.getLogger("disagg.bootstrap.server").info("serving on %s", server.endpoint)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        gate.close()
    return 0
