"""Hosts as network namespaces (scripts/netns.sh): node i has front address 10.231.0.i (HTTP)
and data address 10.232.0.i (control, bootstrap, Mooncake). Torn down even when a test fails."""

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

NETNS = str(Path(__file__).resolve().parents[2] / "scripts" / "netns.sh")


@dataclass(frozen=True)
class Hosts:
    name: str
    nodes: int

    def prefix(self, i: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", f"{self.name}n{i}")

    @staticmethod
    def front(i: int) -> str:
        return f"10.231.0.{i}"

    @staticmethod
    def data(i: int) -> str:
        return f"10.232.0.{i}"

    def link(self, i: int, state: str) -> None:
        subprocess.run([NETNS, "link", self.name, str(i), state], check=True)


def make_hosts(nodes: int):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError(
            "twonode tests need root and iproute2 (scripts/setup.sh installs iproute2); "
            "deselect them with -m 'not twonode'"
        )
    name = f"dg{os.getpid() % 100000}"
    subprocess.run([NETNS, "up", name, str(nodes)], check=True)
    return Hosts(name, nodes)


@pytest.fixture(scope="module")
def hosts4():
    h = make_hosts(4)
    try:
        yield h
    finally:
        subprocess.run([NETNS, "down", h.name], check=True)
