"""`disagg <command>`: one subcommand per role; each module adds its parser and a run().

Command modules import only what their flags need at the top (no torch, no transformers, no
Mooncake), so `disagg --help` and every `disagg <command> --help` answer in well under a
second; run() imports the rest. Flag values come from the command line, DISAGG_<FLAG>, and
--config FILE (disagg/config.py)."""

import argparse
import os
import signal
import sys
import threading

from disagg import __version__, config
from disagg.errors import DisaggError
from disagg.bootstrap import cmd as bootstrap_cmd
from disagg.decode import cmd as decode_cmd
from disagg.prefill import cmd as prefill_cmd
from disagg.router import cmd as router_cmd
from disagg.tools import bench, demo, keygen, presets

COMMANDS = {
    "prefill": prefill_cmd,
    "decode": decode_cmd,
    "router": router_cmd,
    "bootstrap": bootstrap_cmd,
    "bench": bench,
    "demo": demo,
    "presets": presets,
    "keygen": keygen,
}
CONFIGURABLE = ("prefill", "decode", "router", "bootstrap", "bench", "demo")  # --config, --print-config
SERVERS = ("prefill", "decode", "router")  # long-running: they exit at once once closed (process.exit_now)


class Parser(argparse.ArgumentParser):
    """A mistake is one line (the command, the flag, what would work) and a pointer to --help,
    not the usage block before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI; `.commands` maps each command to its own parser."""
    parser = Parser(prog="disagg", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command", parser_class=Parser)
    subs = {}
    for name, module in COMMANDS.items():
        subs[name] = p = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_parser(p)
        if name in CONFIGURABLE:
            config.add_config_flags(p)
            config.document(p)
    parser.commands = subs
    return parser


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C works even where the launching shell ignored SIGINT (a background job, nohup):
        # Python leaves an inherited SIG_IGN in place. Servers then set their own handlers.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    subs = parser.commands
    command = next((t for t in argv if not t.startswith("-")), None)
    if command in CONFIGURABLE:
        try:
            config.apply(subs[command], command, argv[argv.index(command) + 1 :], {c: subs[c] for c in CONFIGURABLE})
        except config.SourceError as exc:
            subs[command].error(str(exc))  # usage + one line, exit 2
    if command in CONFIGURABLE and "--print-config" in argv:  # what is set so far, required flags or not
        for action in subs[command]._actions:
            action.required = False
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named on the command it was given to, not the top level
        subs[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if getattr(args, "print_config", False):
            config.print_config(subs[command], command, args)
            return 0
        code = COMMANDS[args.command].run(args) or 0
    except DisaggError as exc:  # a setting that cannot work (a forced transport, ...): one line, no traceback
        print(f"disagg {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM to a launcher (demo): what it started is stopped
        print(f"disagg {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `disagg presets | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    if args.command in SERVERS:
        from disagg.process import exit_now

        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
