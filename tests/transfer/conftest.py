import os

import pytest

from transfer.engine import MooncakeEngine
from transfer.peer_client import PeerProcess

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")


@pytest.fixture(scope="session")
def engine() -> MooncakeEngine:
    return MooncakeEngine("127.0.0.1")


@pytest.fixture(scope="module")
def peer():
    """A receiver in its own process; tests reconfigure its pool as they need."""
    with PeerProcess("tiny-hybrid", 4, 4096) as p:
        yield p
