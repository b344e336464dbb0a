"""`disagg <command>`: one subcommand per role; each module adds its parser and a run()."""

import argparse
import os
import sys

from disagg import __version__
from disagg.errors import DisaggError
from disagg.bootstrap import cmd as bootstrap_cmd
from disagg.decode import cmd as decode_cmd
from disagg.prefill import cmd as prefill_cmd
from disagg.router import cmd as router_cmd
from disagg.tools import bench, demo, keygen, presets

COMMANDS = {"prefill": prefill_cmd, "decode": decode_cmd, "router": router_cmd, "bootstrap": bootstrap_cmd,
            "bench": bench, "demo": demo, "presets": presets, "keygen": keygen}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description=__doc__)
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module in COMMANDS.items():
        module.add_parser(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except DisaggError as exc:   # a setting that cannot work (a forced transport, ...): one line, no traceback
        print(f"disagg {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:      # `disagg presets | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
