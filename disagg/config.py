"""Where a flag's value comes from, for every `disagg` command alike:

    the command line  >  DISAGG_<FLAG> in the environment  >  --config FILE (TOML)  >  built-in

`--page-size` is DISAGG_PAGE_SIZE and `page-size = 16` in the file (top-level keys apply to
every command that has the flag; a `[prefill]`, `[decode]`, ... table to that command only).
Values from the environment and the file go through the flag's own parser, so a mistake there
gets the same one-line message as on the command line, naming where it came from. Two flags
that exclude each other (--max-tokens, --pool-bytes) are settled by source: the one given at
the highest level wins. `--print-config` prints the effective values as a file `--config` reads.
"""

import argparse
import os
import sys
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

METAVARS = {
    "seconds": "SEC",
    "positive_int": "N",
    "int": "N",
    "port": "PORT",
    "float": "X",
    "share": "SHARE",
    "power_of_two": "N",
    "byte_size": "SIZE",
    "host": "ADDR",
}
NO_SOURCE = {"help", "version", "config", "print_config"}  # flags that only the command line sets


def env_name(action: argparse.Action) -> str:
    return "DISAGG_" + action.dest.upper()


def key_name(action: argparse.Action) -> str:
    return action.option_strings[0].removeprefix("--")


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's documented flags that take a value from a source (aliases hidden from
    --help share a documented flag's dest and are left out)."""
    return [a for a in parser._actions if a.option_strings and a.dest not in NO_SOURCE and a.help != argparse.SUPPRESS]


def add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a TOML file of flag values (`page-size = 16`; a [ROLE] table for one command); "
        "flags and DISAGG_<FLAG> variables override it (env DISAGG_CONFIG)",
    )
    g.add_argument(
        "--print-config", action="store_true", help="print the effective values (as a --config file) and exit"
    )


def document(parser: argparse.ArgumentParser) -> None:
    """Append each flag's default and environment variable to its help text."""
    for a in flags(parser):
        if a.metavar is None and a.nargs != 0 and a.choices is None:  # short placeholders: SEC, N, PORT
            a.metavar = METAVARS.get("host" if a.dest.endswith("host") else getattr(a.type, "__name__", ""))
        text = (a.help or "").rstrip()
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            suffix = f"env {env_name(a)}=1"
        elif isinstance(a, argparse.BooleanOptionalAction):
            suffix = f"default: {'on' if a.default else 'off'}; env {env_name(a)}=1 or 0"
        elif a.required:
            suffix = f"required; env {env_name(a)}"
        elif "default" in text:
            suffix = f"env {env_name(a)}"
        else:
            shown = "none" if a.default is None else "empty" if a.default == "" else render(a.default)
            suffix = f"default: {shown}; env {env_name(a)}"
        suffix = suffix.replace("%", "%%")
        a.help = f"{text} [{suffix}]" if text else f"[{suffix}]"


class SourceError(Exception):
    """A value from the environment or the config file that its flag refuses."""


def apply(
    parser: argparse.ArgumentParser,
    command: str,
    argv: list[str],
    everyone: dict[str, argparse.ArgumentParser] | None = None,
) -> None:
    """Set `parser`'s defaults from the environment and the config file (argv wins later, when
    argparse reads it). SourceError names the variable or key and what would work. `everyone`
    (command -> parser) lets a top-level key or table that no command knows be refused."""
    given = {
        a.dest
        for a in parser._actions
        for opt in a.option_strings
        if any(t == opt or t.startswith(opt + "=") for t in argv)
    }
    file_path = _config_path(argv)
    from_file = _file_values(file_path, command, parser, everyone or {command: parser}) if file_path else {}
    taken: dict[int, str] = {}  # mutually exclusive group -> the dest that holds it
    for g in parser._mutually_exclusive_groups:
        for a in g._group_actions:
            if a.dest in given:
                taken[id(g)] = a.dest
    for source in ("env", "file"):
        for a in flags(parser):
            raw = os.environ.get(env_name(a)) if source == "env" else from_file.get(key_name(a))
            if raw is None or raw == "" or a.dest in given:
                continue
            where = f"{env_name(a)}={raw}" if source == "env" else f"{file_path}: {key_name(a)} = {raw!r}"
            group = next((g for g in parser._mutually_exclusive_groups if a in g._group_actions), None)
            if group is not None:
                if taken.get(id(group), a.dest) != a.dest:
                    continue  # a higher source chose the other flag of the group
                taken[id(group)] = a.dest
            parser.set_defaults(**{a.dest: _convert(a, raw, where)})
            a.required = False
            given.add(a.dest)


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.partition("=")[2]
    return os.environ.get("DISAGG_CONFIG") or None


def _file_values(
    path: str, command: str, parser: argparse.ArgumentParser, everyone: dict[str, argparse.ArgumentParser]
) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SourceError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SourceError(f"--config {path}: not TOML: {exc}") from None
    ours = {key_name(a) for a in flags(parser)}
    anyone = {key_name(a) for p in everyone.values() for a in flags(p)}
    strays = sorted(
        k for k, v in data.items() if k not in everyone and (isinstance(v, dict) or k not in anyone)
    )  # a typo, not a flag
    if strays:
        raise SourceError(
            f"--config {path}: no command has a flag or table {', '.join(strays)} (tables: "
            f"{', '.join(f'[{c}]' for c in everyone)})"
        )
    values = {k: v for k, v in data.items() if not isinstance(v, dict) and k in ours}
    table = data.get(command, {})
    if not isinstance(table, dict):
        raise SourceError(f"--config {path}: {command} must be a table ([{command}])")
    unknown = sorted(set(table) - ours)
    if unknown:
        raise SourceError(
            f"--config {path}: [{command}] has no flag {', '.join(unknown)} (`disagg {command} --help` lists them)"
        )
    return {**values, **table}


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        text = str(raw).lower()
        if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise SourceError(f"{where}: want true or false")
        return text in ("1", "true", "yes", "on")
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else str(raw).split()
        return [_one(action, item, where) for item in items]
    return _one(action, raw, where)


def _one(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(raw, (dict, list)):
        raise SourceError(f"{where}: want one value")
    text = str(raw).lower() if isinstance(raw, bool) else str(raw)
    try:
        value = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise SourceError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SourceError(f"{where}: choose from {', '.join(map(str, action.choices))}")
    return value


def render(value: Any) -> str:
    """A value as its flag would take it."""
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return "=".join(v for v in value if v)  # [NAME=]ENDPOINT
    return str(value)


def print_config(parser: argparse.ArgumentParser, command: str, args: argparse.Namespace) -> None:
    """The effective values as a TOML table a --config file can hold."""
    out = [f"# disagg {command}: effective values (command line > DISAGG_<FLAG> > --config > built-in)", f"[{command}]"]
    for a in flags(parser):
        value = getattr(args, a.dest, None)
        out.append(f"# {key_name(a)} = (unset)" if value is None else f"{key_name(a)} = {_toml(value)}")
    sys.stdout.write("\n".join(out) + "\n")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = render(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
