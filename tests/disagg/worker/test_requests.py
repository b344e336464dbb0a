"""The two request tables on their own: every transition, its effects (pages freed, the peer
told, a transfer started) happening exactly once, and the rooms they keep or forget."""

import time

import numpy as np
import pytest

from disagg.control.deadlines import Deadlines
from disagg.control.messages import Abort, TransferDone
from disagg.decode.requests import Phase as D, RequestTable as DecodeTable, Sender
from disagg.errors import ProtocolError
from disagg.prefill import requests as prefill_requests
from disagg.prefill.requests import Compute as C, Delivery, IllegalTransition, Phase as P, RequestTable as PrefillTable
from transfer.report import TransferReport

LONG = Deadlines(10, 10, 10)
PEER, OTHER = b"decode-1", b"decode-2"


class Effects:
    """Records what a table asked for (the decode table's free and send; the prefill table's
    jobs: prefill/jobs.py's TransferJobs)."""

    def __init__(self, refuse: str | None = None, may_stream=lambda r: True, prepare=lambda r, d: None):
        self.freed, self.told, self.submitted, self.progress, self.refuse = [], [], [], [], refuse
        self.may_stream, self.prepare = may_stream, prepare
        self.in_flight = 0  # bytes given up on still on their way (Transport.unsettled)

    def unsettled(self) -> int:
        return self.in_flight

    def free(self, kv, r=None) -> None:  # (decode's Release.free(r); prefill's TransferJobs.free(kv, r))
        self.freed.append(kv)

    def tell(self, peer, msg) -> None:
        self.told.append((peer, msg))

    def prepare_all(self, r, dests):
        """A job each (TransferJobs' one job for a fan-out is its own tests')."""
        return [self.prepare(r, d) for d in dests]

    def submit_all(self, r, dests, progress, finished):
        """A job per destination (TransferJobs' choice of a fan-out is its own tests')."""
        if self.refuse:
            return 0, self.refuse
        for _ in dests:
            self.submitted.append(r)
            self.progress.append(progress)  # streamed: the worker waits on the engine's layers
        return len(dests), None


def prefill_table(deadlines=LONG, refuse=None, **jobs):
    fx = Effects(refuse, **jobs)
    return PrefillTable(epoch=5, deadlines=deadlines, jobs=fx), fx


TOKENS = np.arange(8)


@pytest.mark.parametrize("prompt_first", [True, False])
def test_prefill_meets_both_halves_in_either_order_and_sends_once(prompt_first):
    t, fx = prefill_table()
    if prompt_first:
        r = t.prompt(1, TOKENS)
        assert r.phase is P.AWAITING_DECODE
        assert t.destination(1, PEER, "dst", [0]) is None
    else:
        assert t.destination(1, PEER, "dst", [0]) is None
        assert t.get(1).phase is P.ORPHANED
        r = t.prompt(1, TOKENS)
    assert r.phase is P.COMPUTING and not fx.submitted
    t.computed(r, "kv")
    assert r.phase is P.TRANSFERRING and fx.submitted == [r] and not fx.freed
    done = TransferDone(1, 5, True, report=TransferReport(nbytes=10))
    t.finished(r, True, done=done)
    assert r.phase is P.DONE and fx.freed == ["kv"] and fx.told == [(PEER, done)] and t.get(1) is None


def test_prefill_abort_while_computing_tells_decode_once_and_frees_when_the_kv_arrives():
    t, fx = prefill_table()
    r = t.prompt(2, TOKENS)
    t.destination(2, PEER, "dst", [])
    assert t.fail(r, "aborted: operator") and not t.fail(r, "again")
    assert r.phase is P.FAILED and fx.told == [(PEER, TransferDone(2, 5, False, reason="aborted: operator"))]
    assert not fx.freed  # the computing thread still holds the pages
    t.computed(r, "kv")
    assert fx.freed == ["kv"] and not fx.submitted
    # the room is buried: a late TransferRequest is answered at once, a late prompt fails
    assert t.destination(2, PEER, "dst", []) == TransferDone(2, 5, False, reason="aborted: operator")
    assert t.prompt(2, TOKENS).phase is P.FAILED


def test_prefill_abort_during_a_transfer_waits_for_the_worker():
    t, fx = prefill_table()
    r = t.prompt(3, TOKENS)
    t.destination(3, PEER, "dst", [])
    t.computed(r, "kv")
    assert t.fail(r, "aborted by decode: x")
    assert r.phase is P.STOPPING and r.phase.ended and not fx.told and not fx.freed
    assert t.get(3) is r  # still held: a worker writes into decode's pages
    assert not t.fail(r, "asked again")  # a re-asked Abort is not confirmed early
    t.finished(r, True, done=TransferDone(3, 5, True))  # the send finished anyway
    assert r.phase is P.FAILED and fx.freed == ["kv"]
    assert fx.told == [(PEER, TransferDone(3, 5, False, reason="aborted by decode: x"))]


def test_prefill_refused_submission_and_failed_send_end_the_request():
    t, fx = prefill_table(refuse="shut down")
    r = t.prompt(4, TOKENS)
    t.destination(4, PEER, "dst", [])
    t.computed(r, "kv")
    assert r.phase is P.FAILED and "transfer workers unavailable: shut down" in r.reason and fx.freed == ["kv"]
    t, fx = prefill_table()
    r = t.prompt(5, TOKENS)
    t.destination(5, PEER, "dst", [])
    t.computed(r, "kv")
    t.finished(r, False, "WriteFailed: boom")
    assert r.phase is P.FAILED and fx.told == [(PEER, TransferDone(5, 5, False, reason="WriteFailed: boom"))]


def test_prefill_duplicates_deadlines_and_sweeps():
    t, fx = prefill_table(Deadlines(0.05, 10, 10))
    r = t.prompt(6, TOKENS)
    with pytest.raises(ProtocolError, match="duplicate room 6"):
        t.prompt(6, TOKENS)
    t0 = time.monotonic()
    assert t.wait(r) is P.FAILED and time.monotonic() - t0 < 2
    assert "AWAITING_DECODE deadline of 0.05 s passed (no TransferRequest from decode)" in r.reason
    assert not fx.told  # decode never asked: its late TransferRequest meets the tombstone
    t, fx = prefill_table(Deadlines(10, 5, 10))
    t.destination(7, PEER, "dst", [])
    t.destination(8, OTHER, "dst", [])
    t.get(7).since -= 6  # an orphan that arrived 6 s ago, past the 5 s waiting deadline
    t.sweep(lost_peers={OTHER})
    assert t.get(7) is None and t.get(8) is None
    assert {(p, m.reason) for p, m in fx.told} == {(PEER, "prefill never arrived"), (OTHER, "decode peer silent")}


def decode_table(quarantine_s=60.0, deadlines=LONG):
    fx = Effects()
    return DecodeTable(deadlines, quarantine_s, release=fx, send=fx.tell, landing=fx.unsettled), fx


def test_decode_success_only_from_the_prefill_it_asked():
    t, fx = decode_table()
    r = t.open(1)
    t.admitted(r, "kv", "dst")
    assert t.sending(r, [Sender("tcp://p:1", 9)])
    t.started(1, "tcp://p:1", 8)  # another epoch: ignored
    assert r.phase is D.WAITING_FOR_INPUT
    t.started(1, "tcp://p:1", 9)
    assert r.phase is D.TRANSFERRING and t.hold(1, "tcp://p:1")[0] is r and t.hold(1, "tcp://x:1")[0] is None
    t.let_go(r)
    t.done(TransferDone(1, 9, True, report=TransferReport(nbytes=7)), "tcp://x:1")  # another prefill: ignored
    assert r.phase is D.TRANSFERRING
    t.done(TransferDone(1, 9, True, report=TransferReport(nbytes=10)), "tcp://p:1")
    assert t.wait(r) is D.SUCCESS and t.report(r).sends == 1 and t.report(r).nbytes == 10
    t.finish(r)
    assert fx.freed == [r] and t.get(1) is None and not fx.told


def test_decode_failure_after_sending_is_quarantined_until_prefill_confirms():
    t, fx = decode_table()
    r = t.open(2)
    t.sending(r, [Sender("tcp://p:1", 9)])
    assert t.fail(r, "aborted: client") and r.phase is D.ABORTING and t.hold(2, "tcp://p:1")[0] is None
    t.finish(r)
    assert r.phase is D.QUARANTINED and fx.told == [("tcp://p:1", Abort(2, "aborted: client"))] and not fx.freed
    with pytest.raises(ProtocolError, match="duplicate room 2"):
        t.open(2)  # the room stays taken while its pages are held
    assert t.sweep() == [] and len(fx.told) == 2  # asked again
    t.done(TransferDone(2, 9, False, reason="aborted"), "tcp://p:1")
    assert fx.freed == [r] and t.quarantined() == 0 and t.open(2).phase is D.BOOTSTRAPPING


def test_an_unsettled_transfer_done_keeps_the_pages_until_a_settled_one_or_the_cap():
    """Prefill lost this decode with writes in flight and gave up on them (they may still land):
    its TransferDone(settled=False) fails the request but frees nothing; a settled answer to a
    later Abort frees; a request already quarantined is not freed by an unsettled answer."""
    t, fx = decode_table()
    r = t.open(2)
    t.sending(r, [Sender("tcp://p:1", 9)])
    t.started(2, "tcp://p:1", 9)
    t.done(TransferDone(2, 9, False, reason="WritesAbandoned: link closed", settled=False), "tcp://p:1")
    assert t.wait(r) is D.ABORTING and "WritesAbandoned" in r.reason
    t.finish(r)
    assert r.phase is D.QUARANTINED and not fx.freed and fx.told == [("tcp://p:1", Abort(2, r.reason))]
    t.done(TransferDone(2, 9, False, reason="aborted by decode", settled=False), "tcp://p:1")  # still in flight
    assert r.phase is D.QUARANTINED and not fx.freed
    t.done(TransferDone(2, 9, False, reason="aborted by decode"), "tcp://p:1")  # the abandoned writes ended
    assert fx.freed == [r] and t.quarantined() == 0
    # the prefill table: a worker that gave up says so in the TransferDone decode hears
    p, pfx = prefill_table()
    q = p.prompt(5, TOKENS)
    p.destination(5, PEER, "dst", [])
    p.computed(q, "kv")
    p.finished(q, False, "WritesAbandoned: link closed", settled=False)
    assert q.phase is P.FAILED and pfx.told == [
        (PEER, TransferDone(5, 5, False, reason="WritesAbandoned: link closed", settled=False))
    ]


def test_a_failed_write_whose_bytes_are_still_on_their_way_is_not_settled_on_either_side():
    """A write that failed may leave bytes in its closed socket that still land (Mooncake TCP:
    transports/proc_tcp.py): prefill's TransferDone(fail) says settled only when none of the
    process's are left, and decode believes a settled answer only while none of a sender's
    is still arriving at its own sockets."""
    p, pfx = prefill_table()
    q = p.prompt(5, TOKENS)
    p.destination(5, PEER, "dst", [])
    p.computed(q, "kv")
    pfx.in_flight = 2
    p.finished(q, False, "WriteFailed: no progress")  # not abandoned, but bytes are in flight
    assert pfx.told == [(PEER, TransferDone(5, 5, False, reason="WriteFailed: no progress", settled=False))]
    t, fx = decode_table()
    r = t.open(2)
    t.sending(r, [Sender("tcp://p:1", 9)])
    t.started(2, "tcp://p:1", 9)
    fx.in_flight = 1  # a closed connection's bytes not read yet
    t.done(TransferDone(2, 9, False, reason="WriteFailed: no progress"), "tcp://p:1")
    assert t.wait(r) is D.ABORTING
    t.finish(r)
    t.done(TransferDone(2, 9, False, reason="aborted by decode"), "tcp://p:1")
    assert r.phase is D.QUARANTINED and not fx.freed
    fx.in_flight = 0
    t.done(TransferDone(2, 9, False, reason="aborted by decode"), "tcp://p:1")  # asked again: now it holds
    assert fx.freed == [r] and t.quarantined() == 0


def test_decode_quarantine_cap_peer_loss_and_unsent_failures():
    t, fx = decode_table(quarantine_s=0.0)
    a, b, c = t.open(3), t.open(4), t.open(5)
    t.sending(a, [Sender("tcp://p:1", 9)])
    t.sending(b, [Sender("tcp://q:1", 9)])
    assert t.peer_lost("tcp://p:1", "prefill silent") == 1
    assert a.phase is D.ABORTING and b.phase is D.WAITING_FOR_INPUT
    t.fail(c, "lookup failed")  # never sent: nothing can write into it
    assert c.phase is D.FAILED and not t.sending(c, [Sender("tcp://p:1", 9)])
    t.finish(c)
    t.finish(a)
    assert fx.freed == [c] and t.quarantined() == 1
    assert t.sweep() == [a] and fx.freed == [c, a] and t.quarantined() == 0  # cap passed


def test_decode_abort_before_arrival_and_deadlines():
    t, fx = decode_table(deadlines=Deadlines(10, 0.05, 10))
    assert t.abort(6, "aborted: router gave up") is None
    r = t.open(6)
    assert r.phase is D.FAILED and r.reason == "aborted: router gave up"
    r = t.open(7)
    t.sending(r, [Sender("tcp://p:1", 1)])
    assert t.wait(r) is D.ABORTING and "WAITING_FOR_INPUT deadline" in r.reason


# ---- layer-wise streaming: the table holds pages the engine still writes ------------------


def _streaming(prompt_first=True):
    from transfer.progress import LayerProgress

    t, fx = prefill_table()
    r = t.prompt(1, TOKENS) if prompt_first else None
    if not prompt_first:
        t.destination(1, PEER, "dst", [0])
        r = t.prompt(1, TOKENS)
    progress = LayerProgress(4)
    assert t.streaming(r, "kv", progress)
    return t, fx, r, progress


@pytest.mark.parametrize("prompt_first", [True, False])
def test_prefill_streams_once_both_halves_met_and_says_started_only_when_computed(prompt_first):
    t, fx, r, progress = _streaming(prompt_first)
    if prompt_first:
        assert r.phase is P.AWAITING_DECODE and not fx.submitted
        t.destination(1, PEER, "dst", [0])
    assert r.phase is P.STREAMING and fx.submitted == [r] and fx.progress == [progress] and not fx.told
    t.computed(r, "kv")
    assert r.phase is P.TRANSFERRING and progress.final_layers == 4
    assert [type(m).__name__ for _, m in fx.told] == ["TransferStarted"]  # decode's transfer deadline starts now
    t.finished(r, True, done=TransferDone(1, 5, True))
    assert r.phase is P.DONE and fx.freed == ["kv"]


def test_prefill_streams_only_where_may_stream_says_so_else_starts_once_computed():
    """auto over a link that would slow the compute: no worker while the engine computes (it
    would only wait), one once the KV is computed, and the request is not streamed."""
    from transfer.progress import LayerProgress

    t, fx = prefill_table(may_stream=lambda r: not r.stream_auto)
    r = t.prompt(1, TOKENS, stream_auto=True)
    t.destination(1, PEER, "dst", [0])
    assert t.streaming(r, "kv", LayerProgress(4))
    assert r.phase is P.COMPUTING and not fx.submitted
    t.computed(r, "kv")
    assert r.phase is P.TRANSFERRING and fx.submitted == [r] and fx.progress == [None]
    t.finished(r, True, done=TransferDone(1, 5, True))
    assert r.phase is P.DONE and fx.freed == ["kv"]


def test_prefill_streamed_failure_frees_only_after_the_engine_and_the_worker_let_go():
    t, fx, r, progress = _streaming()
    t.destination(1, PEER, "dst", [0])
    assert r.phase is P.STREAMING
    t.fail(r, "aborted by decode: gone")
    assert r.phase is P.STOPPING and not fx.freed  # the worker may still write
    t.finished(r, False, "Cancelled: stopped")
    assert r.phase is P.FAILED and not fx.freed  # the engine still writes the pages
    t.computed(r, "kv")
    assert fx.freed == ["kv"]
    assert [m.ok for _, m in fx.told if isinstance(m, TransferDone)] == [False]


def test_prefill_engine_failure_while_streaming_waits_for_the_worker_then_frees():
    t, fx, r, progress = _streaming()
    t.destination(1, PEER, "dst", [0])
    t.compute_ended(r, "kv", "prefill: the model engine failed")
    assert r.phase is P.STOPPING and not fx.freed and r.reason == "prefill: the model engine failed"
    t.finished(r, False, "Cancelled")
    assert r.phase is P.FAILED and fx.freed == ["kv"]


def test_prefill_failure_before_decode_arrived_frees_when_the_engine_returns():
    t, fx, r, progress = _streaming()
    t.fail(r, "deadline")
    assert r.phase is P.FAILED and not fx.freed
    t.computed(r, "kv")
    assert fx.freed == ["kv"] and not fx.submitted
    r3 = t.prompt(3, TOKENS)
    t.fail(r3, "gone")
    assert not t.streaming(r3, "kv3", progress)  # an ended request: the caller keeps its pages


# ---- TP instances: several destinations (prefill) and several senders (decode) ------------

TWO = frozenset({0, 1})  # a prefill rank of TP 1 sends to both ranks of a decode of TP 2


def test_prefill_waits_for_every_decode_rank_then_sends_each_its_share_and_ends_when_all_are_sent():
    t, fx = prefill_table()
    r = t.prompt(1, TOKENS)
    assert t.destination(1, PEER, "dst0", [0], rank=0, tp_size=2, receivers=TWO) is None
    t.computed(r, "kv")
    assert r.phase is P.AWAITING_DECODE and not fx.submitted  # decode rank 1 has not asked yet
    assert t.destination(1, OTHER, "dst1", [1], rank=1, tp_size=2, receivers=TWO) is None
    assert r.phase is P.TRANSFERRING and fx.submitted == [r, r] and r.writers == 2
    first = TransferDone(1, 5, True, report=TransferReport(nbytes=10))
    t.finished(r, True, done=first, dest=r.dests[1])
    assert r.phase is P.TRANSFERRING and fx.told == [(OTHER, first)] and not fx.freed  # its KV is complete
    second = TransferDone(1, 5, True, report=TransferReport(nbytes=12))
    t.finished(r, True, done=second, dest=r.dests[0])
    assert r.phase is P.DONE and fx.freed == ["kv"] and fx.told == [(OTHER, first), (PEER, second)]
    assert t.get(1) is None


def test_prefill_one_failed_destination_stops_the_others_and_tells_every_one_not_yet_told():
    t, fx = prefill_table()
    r = t.prompt(2, TOKENS)
    t.destination(2, PEER, "d0", [], rank=0, tp_size=2, receivers=TWO)
    t.destination(2, OTHER, "d1", [], rank=1, tp_size=2, receivers=TWO)
    t.computed(r, "kv")
    t.finished(r, False, "WriteFailed: boom", dest=r.dests[0])
    assert r.phase is P.STOPPING and not fx.freed and not fx.told  # rank 1's worker still writes
    t.finished(r, True, done=TransferDone(2, 5, True), dest=r.dests[1])  # finished, but r failed
    assert r.phase is P.FAILED and fx.freed == ["kv"]
    assert sorted(fx.told) == sorted(
        [
            (PEER, TransferDone(2, 5, False, reason="WriteFailed: boom")),
            (OTHER, TransferDone(2, 5, False, reason="WriteFailed: boom")),
        ]
    )


def test_prefill_refuses_a_second_claim_of_a_rank_another_tp_size_and_a_rank_it_does_not_feed():
    t, fx = prefill_table()
    r = t.prompt(3, TOKENS)
    assert t.destination(3, PEER, "d0", [], rank=0, tp_size=2, receivers=TWO) is None
    assert t.destination(3, PEER, "again", [], rank=0, tp_size=2, receivers=TWO) is None  # a repeat: ignored
    claim = t.destination(3, OTHER, "d0'", [], rank=0, tp_size=2, receivers=TWO)
    assert not claim.ok and "decode rank 0 of room 3 is claimed by another connection" in claim.reason
    size = t.destination(3, OTHER, "d", [], rank=1, tp_size=4, receivers=frozenset({0, 1, 2, 3}))
    assert not size.ok and "TP size 2, not 4" in size.reason
    stranger = t.destination(4, OTHER, "d", [], rank=3, tp_size=4, receivers=frozenset({0, 1}))
    assert not stranger.ok and "holds none of decode rank 3's share" in stranger.reason and t.get(4) is None
    assert r.dests[0].dst == "d0" and set(r.dests) == {0} and r.phase is P.AWAITING_DECODE and not fx.told
    t.destination(3, OTHER, "d1", [], rank=1, tp_size=2, receivers=TWO)
    assert r.phase is P.COMPUTING


def test_prefill_orphan_destinations_wait_for_the_missing_rank_after_the_prompt():
    t, fx = prefill_table()
    t.destination(5, PEER, "d0", [], rank=0, tp_size=2, receivers=TWO)
    r = t.prompt(5, TOKENS)
    assert r.phase is P.AWAITING_DECODE
    t.destination(5, OTHER, "d1", [], rank=1, tp_size=2, receivers=TWO)
    assert r.phase is P.COMPUTING


def test_decode_succeeds_only_once_every_sender_is_done_and_sums_their_reports():
    t, fx = decode_table()
    r = t.open(1)
    a, b = Sender("tcp://p:1", 9, [0]), Sender("tcp://p:2", 7, [1])
    t.admitted(r, "kv", "dst")
    assert t.sending(r, [a, b]) and r.slots == [0, 1]
    t.started(1, "tcp://p:2", 7)
    assert r.phase is D.TRANSFERRING and t.hold(1, "tcp://p:2") == (r, b)
    t.let_go(r)
    t.done(
        TransferDone(1, 9, True, report=TransferReport(nbytes=10, ranges=2, transfer_ms=3.0, mode="direct")),
        "tcp://p:1",
    )
    assert r.phase is D.TRANSFERRING  # rank 1's share has not landed
    t.done(
        TransferDone(1, 7, True, report=TransferReport(nbytes=5, ranges=1, transfer_ms=4.0, mode="staged")), "tcp://p:2"
    )
    assert t.wait(r) is D.SUCCESS
    report = t.report(r)
    assert (report.nbytes, report.ranges, report.transfer_ms, report.mode, report.sends) == (
        15,
        3,
        4.0,
        "direct+staged",
        2,
    )
    t.finish(r)
    assert fx.freed == [r] and not fx.told


@pytest.mark.parametrize("end", ["finish", "quarantine then settled", "quarantine cap"])
def test_decode_a_request_held_by_a_scatter_is_freed_by_the_last_let_go_never_before(end):
    """Issue 40 (scatter workers): a chunk's scatter holds its request from the loop's hold to
    its let_go; a request that ends meanwhile (freed at once, or after its quarantine) is
    freed exactly once, by the last let_go, and a worker's recheck (live) says no once it
    failed, so a chunk still waiting is never written."""
    t, fx = decode_table(quarantine_s=0.0 if end == "quarantine cap" else 10.0)
    r = t.open(3)
    t.admitted(r, "kv", "dst")
    t.sending(r, [Sender("tcp://p:1", 9, [0, 1])])
    assert t.hold(3, "tcp://p:1")[0] is r and t.hold(3, "tcp://p:1")[0] is r and t.live(r)
    if end == "finish":
        t.done(TransferDone(3, 9, True, report=TransferReport(nbytes=1)), "tcp://p:1")
    else:
        t.fail(r, "aborted: client")
    assert not t.live(r) and t.hold(3, "tcp://p:1") == (None, None)
    t.finish(r)
    if end == "quarantine then settled":
        t.done(TransferDone(3, 9, False, reason="aborted"), "tcp://p:1")
    elif end == "quarantine cap":
        t.sweep()
    assert t.get(3) is None and not fx.freed and not t.live(r)  # forgotten, not freed: a scatter runs
    t.let_go(r)
    assert not fx.freed
    t.let_go(r)
    assert fx.freed == [r]


def test_decode_one_failed_sender_holds_the_pages_until_the_others_stopped_writing():
    t, fx = decode_table()
    r = t.open(2)
    t.sending(r, [Sender("tcp://p:1", 9), Sender("tcp://p:2", 7)])
    t.done(TransferDone(2, 9, False, reason="WriteFailed: boom"), "tcp://p:1")
    assert t.wait(r) is D.ABORTING and r.reason == "prefill: WriteFailed: boom"  # p:2 may still write
    t.finish(r)
    assert r.phase is D.QUARANTINED and fx.told == [("tcp://p:2", Abort(2, r.reason))] and not fx.freed
    t.done(TransferDone(2, 7, False, reason="aborted by decode"), "tcp://p:2")
    assert fx.freed == [r] and t.quarantined() == 0
    # a sender lost: only the requests it feeds fail
    t2, fx2 = decode_table()
    c, d = t2.open(3), t2.open(4)
    t2.sending(c, [Sender("tcp://p:1", 9), Sender("tcp://p:2", 7)])
    t2.sending(d, [Sender("tcp://p:1", 9)])
    t2.done(TransferDone(4, 9, True), "tcp://p:1")
    assert t2.peer_lost("tcp://p:2", "prefill silent") == 1 and c.phase is D.ABORTING and d.phase is D.SUCCESS


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_rank_that_feeds_no_decode_rank_is_done_once_computed(stream):
    """MLA at prefill TP 2 -> decode TP 1: the latent is replicated and rank 0 sends it, so
    rank 1 expects no TransferRequest (the router said the decode TP size) and ends DONE."""
    from transfer.progress import LayerProgress

    t, fx = prefill_table()
    r = t.prompt(1, TOKENS, receivers=frozenset(), tp_size=1)
    assert r.phase is P.COMPUTING
    if stream:
        progress = LayerProgress(4)
        assert t.streaming(r, "kv", progress)
        assert r.phase is P.COMPUTING and not fx.freed  # the engine still writes
    t.computed(r, "kv")
    assert r.phase is P.DONE and fx.freed == ["kv"] and not fx.submitted and not fx.told and t.get(1) is None
    # a decode request that says another TP size than the router's fails the room
    r = t.prompt(2, TOKENS, receivers=TWO, tp_size=2)
    assert not t.destination(2, PEER, "d", [], rank=0, tp_size=4, receivers=frozenset({0})).ok
    assert r.phase is P.AWAITING_DECODE


@pytest.mark.parametrize("order", ["decode, prompt, pages", "prompt, pages, decode", "prompt, decode, pages"])
def test_prefill_prepares_each_destinations_send_while_computing_once_both_are_known(order):
    """A destination's send is laid out once the pages (their indices) and the destination
    are both known and the KV is not computed yet: once each, never after computed()."""
    prepared = []
    t, fx = prefill_table(prepare=lambda r, d: (prepared.append((r.room, d.rank, r.src)), "job")[1])
    r = None
    for step in order.split(", "):
        if step == "decode":
            t.destination(1, PEER, "dst0", [0], rank=0, tp_size=2, receivers=frozenset({0, 1}))
        elif step == "prompt":
            r = t.prompt(1, TOKENS)
        else:
            assert not prepared  # nothing before the pages are known
            t.allocated(r, "src")
    assert prepared == [(1, 0, "src")]
    t.destination(1, OTHER, "dst1", [0], rank=1, tp_size=2, receivers=frozenset({0, 1}))  # comes meanwhile
    t.allocated(r, "src")  # a second call: no repeat
    assert prepared == [(1, 0, "src"), (1, 1, "src")] and r.phase is P.COMPUTING
    t.computed(r, "kv")
    assert r.phase is P.TRANSFERRING and len(fx.submitted) == 2 and len(prepared) == 2


def test_prefill_prepares_nothing_for_a_request_that_ended_or_was_computed_first():
    prepared = []
    t, fx = prefill_table(prepare=lambda r, d: prepared.append(r.room))
    r = t.prompt(1, TOKENS)
    t.abort(1, "client left")
    t.allocated(r, "src")
    t.destination(1, PEER, "dst", [0])
    r2 = t.prompt(2, TOKENS)
    t.allocated(r2, "src")
    t.computed(r2, "kv")  # the KV was computed before decode's destinations came
    t.destination(2, PEER, "dst0", [0], rank=0, tp_size=2, receivers=frozenset({0, 1}))  # not sent yet
    assert r2.phase is P.AWAITING_DECODE and prepared == []
    t.destination(2, OTHER, "dst1", [0], rank=1, tp_size=2, receivers=frozenset({0, 1}))
    assert prepared == [] and fx.submitted == [r2, r2]


# ---- the prefill record's three axes: each moves forward only, along its listed moves ---------


@pytest.mark.parametrize("axis", [P, C, Delivery])
def test_prefill_axes_move_forward_only_and_a_move_not_listed_raises(axis):
    """Every axis is a graph without a cycle (no state comes back), and step() refuses every
    move it does not list, a state to itself included."""
    order = list(axis)
    for now in axis:
        for to in axis:
            if order.index(to) <= order.index(now) and not (axis is P and (now, to) == (P.ORPHANED, P.AWAITING_DECODE)):
                with pytest.raises(IllegalTransition, match=f"{now.name} -> {to.name}"):
                    prefill_requests.step(now, to)
    # ORPHANED -> AWAITING_DECODE is the one move against the enum's order; it is still forward:
    assert prefill_requests.step(P.ORPHANED, P.AWAITING_DECODE) is P.AWAITING_DECODE
    with pytest.raises(IllegalTransition):
        prefill_requests.step(P.AWAITING_DECODE, P.ORPHANED)
    ended = [s for s in axis if s in (P.DONE, P.FAILED, C.RELEASED, Delivery.TOLD)]
    for last in ended:
        for to in axis:
            with pytest.raises(IllegalTransition):
                prefill_requests.step(last, to)


def test_prefill_each_axis_follows_one_request_through_a_streamed_send():
    t, fx, r, progress = _streaming()
    assert (r.phase, r.compute) == (P.AWAITING_DECODE, C.STREAMING)
    t.destination(1, PEER, "dst", [0])
    d = r.dests[0]
    assert (r.phase, r.compute, d.delivery) == (P.STREAMING, C.STREAMING, Delivery.WRITING)
    t.computed(r, "kv")
    assert (r.phase, r.compute, d.delivery) == (P.TRANSFERRING, C.COMPUTED, Delivery.WRITING)
    t.finished(r, True, done=TransferDone(1, 5, True, report=TransferReport(nbytes=3)))
    assert (r.phase, r.compute, d.delivery) == (P.DONE, C.RELEASED, Delivery.TOLD) and fx.freed == ["kv"]
    assert t.report(r).nbytes == 3


def test_prefill_a_transition_the_table_does_not_list_raises_and_changes_nothing():
    """A second report from one worker, a second computed(), a handover after the pages were
    computed, and a destination that never started reporting are bugs: they raise, and the
    request, its pages and decode are left as they were (no double free, no second word)."""
    t, fx = prefill_table()
    r = t.prompt(1, TOKENS)
    t.destination(1, PEER, "d0", [], rank=0, tp_size=2, receivers=TWO)
    t.destination(1, OTHER, "d1", [], rank=1, tp_size=2, receivers=TWO)
    t.computed(r, "kv")
    with pytest.raises(IllegalTransition, match="Compute COMPUTED -> COMPUTED"):
        t.computed(r, "kv again")
    with pytest.raises(IllegalTransition, match="Compute COMPUTED -> STREAMING"):
        t.streaming(r, "kv", None)
    first = TransferDone(1, 5, True)
    t.finished(r, True, done=first, dest=r.dests[0])
    with pytest.raises(IllegalTransition, match="Delivery TOLD -> STOPPED"):
        t.finished(r, True, done=first, dest=r.dests[0])
    assert r.phase is P.TRANSFERRING and r.dests[1].delivery is Delivery.WRITING and r.kv == "kv"
    assert fx.told == [(PEER, first)] and not fx.freed
    t.finished(r, True, done=TransferDone(1, 5, True), dest=r.dests[1])
    assert r.phase is P.DONE and fx.freed == ["kv"]
    with pytest.raises(IllegalTransition, match="Compute RELEASED"):
        t.computed(r, "kv")  # the pages went back once: never twice
    assert fx.freed == ["kv"]
    # a destination whose worker never started cannot report
    t, fx = prefill_table()
    r = t.prompt(2, TOKENS)
    t.destination(2, PEER, "d0", [], rank=0, tp_size=2, receivers=TWO)
    with pytest.raises(IllegalTransition, match="Delivery WAITING -> STOPPED"):
        t.finished(r, False, "boom", dest=r.dests[0])
    assert r.phase is P.AWAITING_DECODE and not fx.told and t.get(2) is r


def test_prefill_pages_the_table_holds_are_freed_once_by_whoever_lets_go_last():
    """The Compute axis decides who frees: the HTTP thread's pages (PENDING, ALLOCATED) when
    r ended before the table took them; the table's (STREAMING -> COMPUTED or BROKEN) once
    the engine and the last worker let go."""
    t, fx = prefill_table()
    r = t.prompt(1, TOKENS)
    t.allocated(r, "src")
    assert r.compute is C.ALLOCATED
    t.fail(r, "aborted")
    t.compute_ended(r, "kv", "prefill: the model engine failed")
    assert r.compute is C.RELEASED and fx.freed == ["kv"] and r.reason == "aborted"
    t, fx, r, progress = _streaming()
    t.destination(1, PEER, "dst", [0])
    t.compute_ended(r, "kv", "prefill: the model engine failed")
    assert (r.phase, r.compute) == (P.STOPPING, C.BROKEN) and not fx.freed
    t.finished(r, False, "Cancelled")
    assert (r.phase, r.compute, r.dests[0].delivery) == (P.FAILED, C.RELEASED, Delivery.TOLD)
    assert fx.freed == ["kv"]
