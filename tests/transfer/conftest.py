import os

import pytest

from harness import memory
from harness.peer_client import LocalPeer, PeerProcess
from transfer.transports import TransportSettings, create

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")
memory.register()


@pytest.fixture(scope="session")
def mooncake():
    [t] = create(["mooncake"], TransportSettings("127.0.0.1"))
    return t


@pytest.fixture(scope="module", params=["mooncake", "memory"])
def kind(request) -> str:
    """Sender/receiver conformance: every test using `transport` and `peer` runs over the real
    Mooncake engine (receiver in another process) and the fake memory transport (in-process)."""
    return request.param


@pytest.fixture(scope="module")
def transport(kind, mooncake):
    return mooncake if kind == "mooncake" else memory.MemoryTransport()


@pytest.fixture(scope="module")
def peer(kind, transport):
    """A receiver; tests reconfigure its pool as they need."""
    if kind == "mooncake":
        with PeerProcess("tiny-hybrid", 4, 4096) as p:
            yield p
    else:
        with LocalPeer(memory.MemoryTransport(), "tiny-hybrid", 4, 4096) as p:
            yield p
