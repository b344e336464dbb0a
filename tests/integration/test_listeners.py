"""Every listener binds the host the operator chose (issue 35, item 7), read from the kernel's
socket table for each process: /proc/PID/fd names its sockets, /proc/PID/net/tcp{,6} their
addresses. The one exception is Mooncake's, which binds every address whatever it is told
(docs/security.md, "The doors"): exactly its two ports (handshake and data), and no more."""

import argparse
import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest

from disagg.cli import build_parser
from disagg.prefill import cmd as prefill_cmd
from disagg.tools.launcher import Launcher
from transfer.transports.mooncake import ENGINES_TCP

pytestmark = pytest.mark.slow

COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "1024", "--max-requests", "2"]
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address (host byte order per 32-bit word) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.add((_address(addr), int(port, 16)))
    return found


def _wildcard(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified


def test_the_listeners_of_every_process_are_on_the_chosen_host():
    with Launcher() as launcher:
        boot = launcher.start("bootstrap", "--bootstrap-bind", "tcp://127.0.0.1:*")
        prefill = launcher.start("prefill", *COMMON, "--host", "127.0.0.1", "--bootstrap-bind", "tcp://127.0.0.1:*")
        ranked = launcher.start(
            "prefill", *COMMON, "--host", "127.0.0.1", "--bootstrap-bind", "none", "--bootstrap-addr", boot["bootstrap"]
        )
        decode = launcher.start(
            "decode",
            *COMMON,
            "--host",
            "127.0.0.1",
            "--bootstrap-addr",
            prefill["bootstrap"],
            "--mooncake-engines",
            "2",
        )
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        ours = {  # Mooncake's wildcard listeners: a handshake and a data port per engine
            "bootstrap": (boot, 0),
            "prefill": (prefill, 2 * ENGINES_TCP),
            "prefill with an external bootstrap": (ranked, 2 * ENGINES_TCP),
            "decode": (decode, 4),
            "router": (router, 0),
        }
        for name, (ready, mooncake) in ours.items():
            found = listeners(ready["pid"])
            wild = {l for l in found if _wildcard(l[0])}
            assert found - wild, f"{name}: no listener found"
            assert all(addr == "127.0.0.1" for addr, _ in found - wild), f"{name}: {sorted(found)}"
            assert len(wild) == mooncake, f"{name}: listens on every address at {sorted(wild)}"
        assert ("127.0.0.1", int(boot["bootstrap"].rsplit(":", 1)[1])) in listeners(boot["pid"])
        assert ("127.0.0.1", int(prefill["bootstrap"].rsplit(":", 1)[1])) in listeners(prefill["pid"])
        assert ("127.0.0.1", int(prefill["control"].rsplit(":", 1)[1])) in listeners(prefill["pid"])


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_bootstrap_listens_on_the_chosen_host_by_default():
    """Issue 35, item 7: both bootstraps bound tcp://0.0.0.0:8998 unless told otherwise."""
    assert _parse("bootstrap").bootstrap_bind == "tcp://127.0.0.1:8998"
    assert prefill_cmd.bootstrap_bind(_parse("prefill")) == "tcp://127.0.0.1:8998"
    assert prefill_cmd.bootstrap_bind(_parse("prefill", "--host", "10.1.2.3")) == "tcp://10.1.2.3:8998"
    assert prefill_cmd.bootstrap_bind(_parse("prefill", "--bootstrap-bind", "none")) is None
    assert prefill_cmd.bootstrap_bind(_parse("prefill", "--bootstrap-bind", "tcp://0.0.0.0:9")) == "tcp://0.0.0.0:9"


def test_reading_the_socket_table():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listeners(os.getpid())
