"""Decode meeting prefill ranks through a real bootstrap (real ZMQ, CURVE): a registration
sent to a prefill that died after the lookup named it is given up once the prefill has been
silent for dead_after_s, and every request waiting on it looks the rank up again, so the
prefill's successor serves them within their deadline (CI: three requests failed "did not
answer the registration in time" because they joined a readiness check's registration to a
dead rank and waited out their whole deadline on it)."""

import threading
import time

import pytest

from disagg.bootstrap.server import BootstrapClient, BootstrapConfig, BootstrapServer
from disagg.control.messages import PROTOCOL_VERSION, LayoutInfo, RegisterDecode, RegisterPrefill
from disagg.decode.introducer import Introducer
from disagg.decode.peers import PrefillPeers
from disagg.errors import ProtocolError, Unanswered
from transfer.buffers import Buffer

LAYOUT = LayoutInfo(16, "page_major", [Buffer(0, 4096 * 8, 4096, "full", None, None)])
DEAD = "tcp://127.0.0.1:7001"  # nothing answers there
SUCCESSOR = "tcp://127.0.0.1:7002"


def _prefill(endpoint: str, epoch: int) -> RegisterPrefill:
    return RegisterPrefill(PROTOCOL_VERSION, 0, 1, endpoint, epoch, LAYOUT)


class OneRank:
    """Decode TP 1 receiving from prefill TP 1: rank 0 only (SenderRanks needs a pool)."""

    def sender_ranks(self, rank0: RegisterPrefill) -> tuple[int, ...]:
        return (0,)


class Prefills:
    """The control link, reduced to what the introducer uses: the live prefills answer a
    registration at once (as decode's loop thread records a Registered), dead ones never."""

    def __init__(self, peers: PrefillPeers, live: set[str]):
        self.peers, self.live, self.sent = peers, live, []

    def send(self, endpoint: str, msg, connect: bool = False) -> None:
        self.sent.append(endpoint)
        if endpoint in self.live:
            self.peers.registered(endpoint, 2, "mooncake")


@pytest.fixture()
def bootstrap(keyed):
    server = BootstrapServer(BootstrapConfig("tcp://127.0.0.1:*", lease_s=0.3, grace_s=0), keyed).start()
    client = BootstrapClient(server.endpoint, keyed)
    yield server, client
    client.close()
    server.stop()


def _introducer(keyed, dead_after_s: float) -> tuple[Introducer, Prefills]:
    peers = PrefillPeers(keyed, LAYOUT, dead_after_s)
    link = Prefills(peers, {SUCCESSOR})
    registration = RegisterDecode(PROTOCOL_VERSION, 9, LAYOUT, [], None)
    return Introducer(peers, OneRank(), link, lambda: registration), link


def _registers(client: BootstrapClient, info: RegisterPrefill) -> bool:
    try:
        client.register(info)
        return True
    except ProtocolError:
        return False


def test_requests_waiting_on_a_dead_prefills_registration_are_served_by_its_successor(keyed, bootstrap, eventually):
    server, client = bootstrap
    client.register(_prefill(DEAD, 1))
    intro, link = _introducer(keyed, dead_after_s=3.0)
    deadline = time.monotonic() + 20.0
    answers: list = []

    def request() -> None:
        try:
            answers.append([p.endpoint for p in intro.senders(server.endpoint, deadline)])
        except ProtocolError as exc:
            answers.append(exc)

    first = threading.Thread(target=request)
    first.start()
    eventually(lambda: link.sent == [DEAD], 10, "the first request registers with the dead prefill")
    second = threading.Thread(target=request)
    second.start()  # joins the registration in flight (no second RegisterDecode)
    successor = _prefill(SUCCESSOR, 2)
    eventually(lambda: _registers(client, successor), 10, "the successor takes the lapsed rank")
    while (first.is_alive() or second.is_alive()) and time.monotonic() < deadline:
        client.register(successor)  # renews its lease, as a live prefill does
        first.join(0.1)
    assert answers == [[SUCCESSOR], [SUCCESSOR]]
    assert link.sent == [DEAD, SUCCESSOR]  # one registration each, shared by both requests
    assert time.monotonic() < deadline - 10  # given up after dead_after_s, not at the deadline


def test_a_registration_unanswered_past_the_deadline_says_so(keyed, bootstrap):
    """The bootstrap names only the dead prefill: the request fails when its deadline passes,
    saying the registration went unanswered (not a hang, not a hot loop of registrations)."""
    server, client = bootstrap
    client.register(_prefill(DEAD, 1))
    intro, link = _introducer(keyed, dead_after_s=0.2)
    with pytest.raises(ProtocolError, match="did not answer the registration|stopped renewing its lease"):
        intro.senders(server.endpoint, time.monotonic() + 1.0)
    assert 1 <= len(link.sent) <= 6


def test_a_request_whose_deadline_comes_first_leaves_the_registration_to_others(keyed, bootstrap):
    """A request with less time than the registration's answer_by fails alone; the
    registration stays in flight for the others (it is not given up for everyone)."""
    server, client = bootstrap
    client.register(_prefill(DEAD, 1))
    intro, link = _introducer(keyed, dead_after_s=30.0)
    with pytest.raises(ProtocolError, match="within the deadline") as failed:
        intro.senders(server.endpoint, time.monotonic() + 0.3)
    assert not isinstance(failed.value, Unanswered)
    info = intro.peers.lookup(server.endpoint, time.monotonic() + 1.0)
    peer, fresh = intro.peers.join(info)
    assert not fresh and peer.endpoint == DEAD and link.sent == [DEAD]
