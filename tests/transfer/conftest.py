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


@pytest.fixture(scope="module", params=["mooncake", "memory", pytest.param("cuda-ipc", marks=pytest.mark.gpu)])
def kind(request) -> str:
    """Sender/receiver conformance: every test using `transport` and `peer` runs over the real
    Mooncake engine (receiver in another process), the fake memory transport (in-process) and,
    on a GPU machine, CUDA IPC (receiver in another process, on the second GPU if there is one)."""
    return request.param


@pytest.fixture(scope="module")
def transport(kind, mooncake):
    if kind == "cuda-ipc":
        [t] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
        return t
    return mooncake if kind == "mooncake" else memory.MemoryTransport()


@pytest.fixture(scope="module")
def peer(kind, transport):
    """A receiver; tests reconfigure its pool as they need."""
    if kind == "memory":
        with LocalPeer(memory.MemoryTransport(), "tiny-hybrid", 4, 4096) as p:
            yield p
        return
    env, device = dict(os.environ), "cpu"
    if kind == "cuda-ipc":
        import torch

        env["CUDA_VISIBLE_DEVICES"] = "1" if torch.cuda.device_count() > 1 else "0"  # its own GPU
        device = "cuda"
    with PeerProcess("tiny-hybrid", 4, 4096, env=env, transport=kind, device=device) as p:
        yield p
