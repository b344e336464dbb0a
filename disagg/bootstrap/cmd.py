"""`disagg bootstrap`: the standalone bootstrap server (it also runs inside `disagg prefill`)."""

import argparse
import json
import sys
from typing import TYPE_CHECKING

from disagg.process import add_process_flags
from disagg.control.auth import add_auth_flags, key_of

if TYPE_CHECKING:
    from disagg.bootstrap.server import BootstrapConfig

HELP = "run the bootstrap server that introduces decode workers to prefill ranks"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bootstrap-bind",
        default="tcp://127.0.0.1:8998",
        metavar="tcp://HOST:PORT",
        help="ZMQ endpoint to serve on: this host only by default; give the address prefill and "
        "decode reach it at (tcp://0.0.0.0:PORT: every address; PORT *: any free port)",
    )
    p.add_argument("--bind", dest="bootstrap_bind", help=argparse.SUPPRESS)  # its former name
    add_process_flags(p)
    add_auth_flags(p)


def config_from(args: argparse.Namespace) -> "BootstrapConfig":
    from disagg.bootstrap.server import BootstrapConfig

    return BootstrapConfig(bind=args.bootstrap_bind)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; once bound, say where (a line for a person on stderr, one
    JSON line on stdout for launchers: with `--bootstrap-bind tcp://HOST:*` it names the port)."""
    import zmq

    from disagg.bootstrap.server import BootstrapServer
    from disagg.control.auth import Gate
    from disagg.process import setup_logging, stop_on_signals

    setup_logging(args.log_level)
    gate = Gate(zmq.Context.instance(), key_of(args), "bootstrap")
    try:
        server = BootstrapServer(config_from(args), gate)
    except BaseException:
        gate.close()
        raise
    stop_on_signals(server.interrupt)
    print(f"disagg bootstrap ready on {server.endpoint}", file=sys.stderr, flush=True)
    print(json.dumps({"role": "bootstrap", "bootstrap": server.endpoint}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop()
        gate.close()
    return 0
