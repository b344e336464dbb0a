"""`disagg bootstrap`: the standalone bootstrap server (it also runs inside `disagg prefill`)."""

import argparse
import logging
from typing import TYPE_CHECKING

from disagg.process import add_process_flags
from disagg.control.auth import add_auth_flags, key_of

if TYPE_CHECKING:
    from disagg.bootstrap.server import BootstrapConfig

HELP = "run the bootstrap server that introduces decode workers to prefill ranks"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-bind", default="tcp://0.0.0.0:8998", metavar="tcp://HOST:PORT",
                   help="ZMQ endpoint to serve on (the same flag as prefill's bootstrap inside it)")
    p.add_argument("--bind", dest="bootstrap_bind", help=argparse.SUPPRESS)   # its former name
    add_process_flags(p)
    add_auth_flags(p)


def config_from(args: argparse.Namespace) -> "BootstrapConfig":
    from disagg.bootstrap.server import BootstrapConfig
    return BootstrapConfig(bind=args.bootstrap_bind)


def run(args: argparse.Namespace) -> int:
    import zmq

    from disagg.bootstrap.server import BootstrapServer
    from disagg.control.auth import Gate
    from disagg.process import setup_logging

    setup_logging(args.log_level)
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
