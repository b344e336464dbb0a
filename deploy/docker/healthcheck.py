"""The images' HEALTHCHECK: ask the disagg server in this container for GET /health, with the
standard library only (the images have no curl). Exit 0 when it answers 200, else 1, with one
line saying why (`docker inspect` shows it).

The server's command line is PID 1's (or this script's arguments, as `disagg ROLE ...`): its
--http-port, else DISAGG_HTTP_PORT (the images set 8080), names the port; the address it serves
on (--http-host, else a worker's --host, or their DISAGG_ variables) is asked unless it is a
wildcard (then loopback). A command that serves no HTTP (bootstrap, bench, ...) is healthy
while it runs: there is nothing to ask.

    python healthcheck.py                                  # in the image, for PID 1
    python healthcheck.py disagg router --http-port 8000   # for the command line given
"""

import os
import sys
import urllib.error
import urllib.request

SERVERS = ("prefill", "decode", "router")  # the commands that serve /health
TIMEOUT_S = 4.0
WILDCARDS = ("", "0.0.0.0", "::")


def command_line(argv: list[str]) -> list[str]:
    if argv:
        return argv
    with open("/proc/1/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def flag(args: list[str], *names: str) -> str | None:
    """The last value given to any of `names` (as `--flag V` or `--flag=V`)."""
    value = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(name + "="):
                value = a.split("=", 1)[1]
    return value


def target(argv: list[str]) -> tuple[str, str] | str:
    """(command, /health URL), or the reason there is nothing to ask."""
    starts = [i for i, a in enumerate(argv) if os.path.basename(a) == "disagg"]
    if not starts or starts[0] + 1 >= len(argv):
        return f"not a disagg server: {' '.join(argv)[:200]}"
    command, args = argv[starts[0] + 1], argv[starts[0] + 2 :]
    if command not in SERVERS:
        return f"disagg {command} serves no HTTP"
    port = flag(args, "--http-port", "--port") or os.environ.get("DISAGG_HTTP_PORT", "")
    if not port.isdigit() or int(port) == 0:
        raise SystemExit(
            f"unhealthy: no fixed HTTP port for disagg {command} (--http-port or DISAGG_HTTP_PORT; "
            f"got {port or 'none'})"
        )
    host = (
        flag(args, "--http-host")
        or os.environ.get("DISAGG_HTTP_HOST")
        or flag(args, "--host")
        or (os.environ.get("DISAGG_HOST", "") if command != "router" else "")
    )  # a worker serves on --host by default
    host = "127.0.0.1" if host in WILDCARDS else host
    return command, f"http://{host}:{port}/health"


def main(argv: list[str]) -> int:
    found = target(command_line(argv))
    if isinstance(found, str):
        print(f"healthy: {found}")
        return 0
    command, url = found
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            print(f"healthy: disagg {command} answered {reply.status} at {url}")
            return 0
    except urllib.error.HTTPError as e:
        print(f"unhealthy: disagg {command} answered {e.code} at {url}: {e.read(300).decode(errors='replace')}")
    except (OSError, ValueError) as e:  # refused, timed out, unresolvable
        print(f"unhealthy: no answer from disagg {command} at {url}: {getattr(e, 'reason', e)}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
