"""Abort in both directions, on real servers in this process (real ZMQ, real Mooncake on
loopback): the other side hears it at once, not at its deadline, and every slot comes back."""

import contextlib
import threading
import time

import numpy as np
import pytest

from disagg.control.messages import (
    PROTOCOL_VERSION,
    Abort,
    Decoder,
    RegisterDecode,
    Registered,
    ToDecode,
    TransferDone,
    encoder,
)
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.control.deadlines import Deadlines
from disagg.worker.pool_settings import PoolSettings

pytestmark = pytest.mark.slow
LONG = Deadlines(bootstrap_s=30, waiting_s=30, transfer_s=30)  # an abort must not wait for these


@pytest.fixture
def pair(StuckEngine):
    from disagg.prefill.server import PrefillConfig, PrefillServer

    pool = PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=4, device="cpu")
    stuck = StuckEngine()
    prefill = PrefillServer(PrefillConfig(pool=pool, bootstrap_bind="tcp://127.0.0.1:*", deadlines=LONG), stuck)
    decode = DecodeServer(DecodeConfig(pool=pool, bootstrap_addr=prefill.bootstrap_endpoint, deadlines=LONG))
    initial = prefill.available(), decode.pool.available()
    threads: list[threading.Thread] = []

    def run(fn, *args) -> dict:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(fn(*args)), daemon=True)
        threads.append(t)
        t.start()
        return out

    yield prefill, decode, stuck, run, initial
    stuck.release.set()
    for t in threads:
        t.join(30)
    prefill.close()
    decode.close()


def _stuck_in_prefill(pair, eventually, room: int) -> tuple[dict, dict]:
    """Start both sides of `room`; return once prefill's engine is busy with it and decode's
    TransferRequest has arrived. The results fill in when each side ends."""
    prefill, decode, stuck, run, _ = pair
    tokens = np.arange(300)
    pre = run(prefill.prefill, room, tokens)
    assert stuck.entered.wait(10)
    dec = run(decode.decode, room, tokens, 2)
    eventually(
        lambda: (r := prefill.requests.get(room)) is not None and r.dests, 10, "prefill holds decode's TransferRequest"
    )
    return pre, dec


def _both_back(prefill, decode, initial) -> bool:
    return (prefill.available(), decode.pool.available()) == initial and decode.quarantined() == 0


def test_prefill_side_abort_reaches_decode_at_once(pair, eventually):
    prefill, decode, stuck, run, initial = pair
    pre, dec = _stuck_in_prefill(pair, eventually, 11)
    t0 = time.monotonic()
    assert prefill.abort(11, "operator") == {"room": 11, "aborted": True, "known": True}
    eventually(lambda: dec.get("state") == "FAILED", 5, "decode hears the abort")
    assert "aborted: operator" in dec["reason"] and time.monotonic() - t0 < 5
    stuck.release.set()  # the engine returns; nothing is transferred
    eventually(lambda: pre.get("state") == "FAILED", 10, "prefill ends the request")
    eventually(lambda: _both_back(prefill, decode, initial), 5, "both pools back")


def test_decode_side_abort_stops_prefill_and_frees_both(pair, eventually):
    prefill, decode, stuck, run, initial = pair
    pre, dec = _stuck_in_prefill(pair, eventually, 12)
    assert decode.abort(12, "client went away")["aborted"]
    eventually(lambda: dec.get("state") == "FAILED", 5, "decode fails")
    # decode's pages are back once prefill confirmed: prefill's TransferDone answers the Abort at once
    eventually(
        lambda: decode.pool.available() == initial[1] and decode.quarantined() == 0,
        5,
        "decode pages back without waiting for the quarantine cap",
    )
    stuck.release.set()
    eventually(lambda: pre.get("state") == "FAILED", 10, "prefill ends the request")
    assert pre["reason"] == "aborted by decode: aborted: client went away"
    eventually(lambda: _both_back(prefill, decode, initial), 5, "both pools back")


def test_an_abort_before_the_request_arrives_fails_it_on_arrival(pair, eventually):
    prefill, decode, stuck, run, initial = pair
    stuck.release.set()
    assert prefill.abort(13, "router gave up") == {"room": 13, "aborted": False, "known": False}
    assert decode.abort(13, "router gave up")["known"] is False
    t0 = time.monotonic()
    out = decode.decode(13, np.arange(50), 1)
    assert out["state"] == "FAILED" and "aborted: router gave up" in out["reason"]
    out = prefill.prefill(13, np.arange(50))
    assert out["state"] == "FAILED" and "aborted: router gave up" in out["reason"]
    assert time.monotonic() - t0 < 5 and _both_back(prefill, decode, initial)


def test_a_late_transfer_request_for_an_ended_room_is_answered_at_once(pair, eventually):
    """Prefill failed the room before decode's TransferRequest came (the upstream trap: decode
    waited for its own 300 s timeout). The tombstone answers it with TransferDone(fail)."""
    prefill, decode, stuck, run, initial = pair
    stuck.release.set()
    prefill.abort(14, "prefill engine failed")
    pre = prefill.prefill(14, np.arange(80))
    assert pre["state"] == "FAILED"
    t0 = time.monotonic()
    out = decode.decode(14, np.arange(80), 1)
    assert out["state"] == "FAILED" and "prefill engine failed" in out["reason"]
    assert time.monotonic() - t0 < 5
    eventually(lambda: _both_back(prefill, decode, initial), 5, "both pools back")
    # and the pair still serves
    tokens = np.arange(120)
    pre = run(prefill.prefill, 15, tokens)
    dec = decode.decode(15, tokens, 2)
    assert dec["state"] == "SUCCESS" and dec["verified"]
    eventually(lambda: pre.get("state") == "SUCCESS", 10, "prefill done")


def test_pages_stay_quarantined_while_an_aborted_transfer_is_still_writing(pair, eventually):
    """Decode aborts while prefill's transfer is inside a write (held here by a gate in front of
    the real send). However often decode asks again, prefill must not confirm until the write
    is over, and decode must not reuse the pages or the room until then."""
    prefill, decode, stuck, run, initial = pair
    stuck.release.set()
    gate, inside = threading.Event(), threading.Event()
    real_send = prefill.sender.send

    def gated_send(*args, **kwargs):
        inside.set()
        assert gate.wait(30)
        return real_send(*args, **kwargs)

    prefill.sender.send = gated_send
    from disagg.control.messages import Abort

    aborts: list[Abort] = []  # every Abort that reaches prefill's control socket
    real_handle = prefill._handle

    def counting_handle(identity, msg):
        if isinstance(msg, Abort):
            aborts.append(msg)
        return real_handle(identity, msg)

    prefill._handle = counting_handle
    tokens = np.arange(400)
    pre = run(prefill.prefill, 21, tokens)
    dec = run(decode.decode, 21, tokens, 2)
    assert inside.wait(10)
    decode.abort(21, "client went away")
    eventually(lambda: dec.get("state") == "FAILED" and pre.get("state") == "FAILED", 5, "both sides ended the request")
    asks_before = len(aborts)

    def still_held_after_two_more_asks() -> bool:
        assert decode.quarantined() == 1 and decode.pool.available() != initial[1], (
            "decode released pages that a running transfer may still write"
        )
        return len(aborts) >= asks_before + 2

    eventually(still_held_after_two_more_asks, 10, "decode asked prefill again, twice")
    again = decode.decode(21, tokens, 2)
    assert again["state"] == "FAILED" and "duplicate room 21" in again["reason"]
    gate.set()  # the write ends; the send sees the abort before its next write
    eventually(lambda: _both_back(prefill, decode, initial), 5, "both pools back once the transfer stopped")


@contextlib.contextmanager
def _registered_socket(prefill, decode, epoch: int):
    """A DEALER registered with prefill as a decode of `epoch` with decode's own pool; yields
    (socket, ask) where ask(msg) sends and returns the decoded reply."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(prefill.control_endpoint)

    def ask(msg):
        sock.send(encoder.encode(msg))
        assert sock.poll(10_000)
        return Decoder(ToDecode, "t").decode(sock.recv())

    try:
        assert isinstance(
            ask(
                RegisterDecode(
                    PROTOCOL_VERSION, epoch, decode.layout, decode.endpoint.offers(), decode.endpoint.staging_info()
                )
            ),
            Registered,
        )
        yield sock, ask
    finally:
        sock.close()


def test_an_abort_from_a_new_connection_stops_a_transfer_not_yet_started(pair, eventually):
    """Decode re-registered on a new socket (it lost the old one) and asks about a room of the
    old connection. Prefill may confirm at once only because it also fails the room, so its
    engine finishing later can never start a transfer into pages decode has freed."""
    prefill, decode, stuck, run, initial = pair
    pre, dec = _stuck_in_prefill(pair, eventually, 31)
    # another decode (its own epoch) may not end the room: ownership, not just a known number
    with _registered_socket(prefill, decode, decode.epoch + 1) as (sock, ask):
        reply = ask(Abort(31, "someone else's room"))
        assert isinstance(reply, TransferDone) and not reply.ok and "not a room of yours" in reply.reason
    assert prefill.requests.get(31) is not None and not prefill.requests.get(31).phase.ended
    with _registered_socket(prefill, decode, decode.epoch) as (sock, ask):  # the same decode, a new socket
        reply = ask(Abort(31, "asked again on a new connection"))
        assert isinstance(reply, TransferDone) and not reply.ok and reply.room == 31
    stuck.release.set()  # the engine finishes: no transfer may start now
    eventually(lambda: pre.get("state") == "FAILED" and dec.get("state") == "FAILED", 10, "both sides failed")
    assert "bytes" not in pre and "aborted by decode" in pre["reason"]
    eventually(lambda: _both_back(prefill, decode, initial), 5, "both pools back")
