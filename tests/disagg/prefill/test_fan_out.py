"""The prefill worker's choice of a fan-out (prefill/jobs.py, TransferJobs.submit_all; issue 40):
a computed request for several decode ranks over links that fan out (Link.fan) goes as ONE job
(transfer.fanout: planned once, written as one), each destination still reported to the
table's `finished` as its own job would (its report, digest, or its own error); over links
that do not fan (Mooncake) nothing changes. The memory transport's MemoryFan (tests/harness)
stands in for cuda-ipc's fan-out to prove the interface; the GPU case is
test_fan_out_gpu.py's."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest

from disagg.control.messages import TransferStarted
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.engine.standin import StandInEngine
from disagg.prefill.jobs import TransferJobs
from disagg.prefill.peers import DecodePeer
from disagg.prefill.requests import Compute, Destination, Phase, PrefillRequest
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from harness import memory
from kvpool import HybridPool
from transfer.config import TransferConfig
from transfer.progress import LayerProgress
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.transports import TransportSettings

PRESET, TOKENS, ROOM = "tiny-swa", 40, 7
DEAD_AFTER_S = 60.0  # (prefill and decode share this process: see test_tp_instances.py)


def _pool(tp_size: int = 1, tp_rank: int = 0) -> PoolSettings:
    return PoolSettings(preset=PRESET, max_tokens=2048, max_requests=4, device="cpu", tp_size=tp_size, tp_rank=tp_rank)


# ---- TransferJobs on its own: real sender, pools and memory links; a recorded `finished` ------


class Io:
    """What the control socket would send (the jobs' TransferStarted)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, peer: bytes, msg) -> None:
        self.sent.append((peer, msg))


@dataclass
class Reported:
    """The table's `finished`, recorded: (ok, reason, done, settled, dest) per call."""

    calls: list = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, r, ok, reason="", done=None, settled=True, dest=None) -> None:
        with self.cond:
            self.calls.append((ok, reason, done, settled, dest))
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 30.0) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= n, timeout), f"{len(self.calls)} of {n} reported"
            return list(self.calls)


class Peers:
    def __init__(self, peers: dict) -> None:
        self._peers = peers

    def get(self, identity: bytes):
        return self._peers.get(identity)


@pytest.fixture(params=[True, False], ids=["links fan", "links do not fan"])
def rig(request):
    """A TP 1 prefill rank's pool and sender, two TP 2 decode ranks' pools (memory links, which
    fan where asked), their shards, and a computed request for both."""
    sender_end = PoolEndpoint(
        memory.MemoryTransport(fan=request.param), HybridPool(_pool().pool_config()), TransferConfig()
    )
    receivers = [
        PoolEndpoint(memory.MemoryTransport(), HybridPool(_pool(2, s).pool_config()), TransferConfig())
        for s in range(2)
    ]
    sender, io, ids = KVSender(sender_end), Io(), np.arange(TOKENS) % 97
    peers, dests, kvs = {}, {}, []
    for s, rx in enumerate(receivers):
        target = sender.connect(rx.offers(), rx.buffers, rx.staging_info(), tp=(2, s))
        name = f"decode-{s}".encode()
        peers[name] = DecodePeer(target, 1, None, ThreadPoolExecutor(1, thread_name_prefix=f"t-{s}"), (2, s))
        kvs.append(rx.pool.alloc_request(TOKENS, swa_window_only=True))
        dests[s] = Destination(name, s, rx.pool.index_set(kvs[-1]), [])
    kv = sender_end.pool.alloc_request(TOKENS)
    StandInEngine().prefill(sender_end.pool, kv, ids, ROOM)
    src = sender_end.pool.index_set(kv)
    r = PrefillRequest(ROOM, Phase.TRANSFERRING, Compute.COMPUTED, tokens=ids, kv=kv, src=src, dests=dests)
    r.receivers, r.tp_size, r.timings["prefill_done_at"] = frozenset({0, 1}), 2, time.time()
    jobs = TransferJobs(1, io, Peers(peers), sender, admission=None)
    yield jobs, r, io, sender_end.transports[0].fanout, receivers, kvs, ids
    for p in peers.values():
        p.workers.shutdown(wait=True)
    for e in (sender_end, *receivers):
        e.close()


def _snapshot(rx: PoolEndpoint) -> list[bytes]:
    return [t.numpy().tobytes() for ts in rx.tensors.values() for t in ts]


def _verified(receivers, kvs, ids) -> None:
    for rx, kv in zip(receivers, kvs):
        StandInEngine().verify(rx.pool, kv, ids, ROOM)


def test_a_computed_request_for_two_ranks_goes_as_one_fan_out_job_and_each_hears_its_own(rig):
    """Links that fan: one job, one fan-out of both receivers, each reported to `finished` in
    order with its TransferDone (its report names the fan-out); its bytes are decode's to
    verify. Links that do not: a job each, as ever (no fan-out in the reports)."""
    jobs, r, io, fan, receivers, kvs, ids = rig
    finished = Reported()
    assert jobs.submit_all(r, list(r.dests.values()), None, finished) == (2, None)
    calls = finished.wait(2)
    assert all(ok and settled and done.ok for ok, _, done, settled, _ in calls), calls
    assert [done.report.fanout for _, _, done, _, _ in calls] == ([2, 2] if fan else [0, 0])
    if fan:
        assert fan.started == [2] and [c[4] for c in calls] == list(r.dests.values())  # one write, reported in order
    assert sorted(peer for peer, msg in io.sent if isinstance(msg, TransferStarted)) == [b"decode-0", b"decode-1"]
    _verified(receivers, kvs, ids)


def test_a_receiver_whose_plan_fails_gets_its_own_error_while_the_other_is_sent(rig):
    jobs, r, io, fan, receivers, kvs, ids = rig
    d1 = r.dests[1]
    d1.dst = type(d1.dst)({c: d1.dst[c] + 10_000 for c in d1.dst.components()})  # pages its pool has not
    finished = Reported()
    assert jobs.submit_all(r, list(r.dests.values()), None, finished) == (2, None)
    by_dest = {c[4].rank: c for c in finished.wait(2)}
    ok, _, done, _, _ = by_dest[0]
    assert ok and done.report.nbytes > 0
    ok, reason, done, settled, _ = by_dest[1]
    assert not ok and done is None and settled and "OutOfBounds" in reason, reason
    if fan:
        assert fan.started == [1] and done is None  # the other went on its own fan-out of one
    StandInEngine().verify(receivers[0].pool, kvs[0], ids, ROOM)


@pytest.mark.parametrize(
    "rig, when",
    [(True, "queued"), (True, "planned"), (False, "queued")],  # (links that do not fan: no fan-out to abort at)
    indirect=["rig"],
    ids=["links fan-queued", "links fan-planned", "links do not fan-queued"],
)
def test_an_aborted_request_cancels_every_receiver_and_writes_nothing(rig, when):
    """Aborted while its job queued (nothing planned, no TransferStarted), or once the fan-out
    was planned and laid out (before its write starts): every receiver Cancelled, as its own
    send would have been; nothing written, nothing abandoned."""
    jobs, r, io, fan, receivers, kvs, ids = rig
    before = [_snapshot(rx) for rx in receivers]
    gate = threading.Event()
    for d in r.dests.values():  # every shard is busy: the jobs queue behind these
        jobs._peers.get(d.peer).workers.submit(gate.wait, 30)
    laid_out = []
    if fan is not None:
        real = fan.prepare
        if when == "planned":
            fan.prepare = lambda parts: (setattr(r, "phase", Phase.STOPPING), real(parts))[1]
        else:  # (aborted while queued: not even planned, as a send alone)
            fan.prepare = lambda parts: (laid_out.append(len(parts)), real(parts))[1]
    finished = Reported()
    assert jobs.submit_all(r, list(r.dests.values()), None, finished) == (2, None)
    if when == "queued":
        r.phase = Phase.STOPPING
    gate.set()
    calls = finished.wait(2)
    assert all(not ok and "Cancelled" in reason and settled for ok, reason, _, settled, _ in calls), calls
    assert fan is None or fan.started == []
    assert laid_out == []
    assert (io.sent == []) is (when == "queued")
    assert [_snapshot(rx) for rx in receivers] == before


def test_a_fan_out_is_laid_out_once_while_computing_and_its_write_only_starts(rig):
    """A request expected to fan out is laid out as one while it computes, once every
    destination is here (one job, the same future on each); the fan-out job takes it and only
    starts the write (its reports say prepared ahead). Links that do not fan: a job each, as
    ever."""
    jobs, r, io, fan, receivers, kvs, ids = rig
    d0, d1 = r.dests[0], r.dests[1]
    del r.dests[1]  # (decode rank 1 not here yet)
    assert jobs.prepare_all(r, [d0]) == [None] if fan else jobs.prepare_all(r, [d0])[0] is not None
    r.dests[1] = d1
    got = jobs.prepare_all(r, [d0, d1])
    if fan is None:
        assert got[0] is not got[1] and all(j.result(30) is not None for j in got)
        return
    assert got[0] is got[1] and got[0].result(30) is not None and fan.started == []  # laid out, not written
    d0.prepared = d1.prepared = got[0]
    finished = Reported()
    assert jobs.submit_all(r, [d0, d1], None, finished) == (2, None)
    calls = finished.wait(2)
    assert all(ok and done.report.prepared_ahead and done.report.fanout == 2 for ok, _, done, _, _ in calls), calls
    assert fan.started == [2] and d0.prepared is None and d1.prepared is None
    _verified(receivers, kvs, ids)


@pytest.mark.parametrize("rig", [True], indirect=True, ids=["links fan"])
def test_destinations_sent_one_by_one_after_a_fan_out_was_laid_out_plan_their_own(rig):
    """A request laid out as one fan-out whose destinations then go one job each (here
    streamed, as after a peer went meanwhile): each send finds a fan-out's job where its own
    prepared send would be, ignores it and plans its own (it was once handed to
    KVSender.send, which could not use it)."""
    jobs, r, io, fan, receivers, kvs, ids = rig
    dests = list(r.dests.values())
    job = jobs.prepare_all(r, dests)[0]
    assert job.result(30) is not None
    for d in dests:
        d.prepared = job
    progress = LayerProgress(jobs._pool.config.model.num_layers, "cpu")
    progress.complete()
    finished = Reported()
    assert jobs.submit_all(r, dests, progress, finished) == (2, None)
    calls = finished.wait(2)
    assert all(ok and done.report.fanout == 0 for ok, _, done, _, _ in calls), calls
    assert fan.started == []
    _verified(receivers, kvs, ids)


@pytest.mark.parametrize("rig", [True], indirect=True, ids=["links fan"])
def test_sends_laid_out_one_by_one_are_dropped_by_a_fan_out_never_waited_for(rig):
    """Sends laid out per destination before the fan-out was expected (a job still queued, one
    done) are dropped: the queued one cancelled, never waited for (the fan-out would hang here
    if it were); the fan-out plans when it sends."""
    jobs, r, io, fan, receivers, kvs, ids = rig
    queued, done = Future(), Future()  # (a job no worker will ever run, and one that ran)
    done.set_result(None)
    r.dests[0].prepared, r.dests[1].prepared = queued, done
    finished = Reported()
    assert jobs.submit_all(r, list(r.dests.values()), None, finished) == (2, None)
    calls = finished.wait(2)
    assert all(ok and not done.report.prepared_ahead for ok, _, done, _, _ in calls), calls
    assert queued.cancelled() and all(d.prepared is None for d in r.dests.values())
    assert fan.started == [2]


# ---- through the real control plane: servers in this process, real ZMQ ------------------------


def _request(prefill, decodes, room: int, tokens) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=lambda: out.__setitem__("prefill", prefill.prefill(room, tokens)))]
    threads += [
        threading.Thread(target=lambda d=d, i=i: out.__setitem__(i, d.decode(room, tokens)))
        for i, d in enumerate(decodes)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize(
    "kind, fans", [("memory", True), pytest.param("mooncake", False, marks=pytest.mark.slow)], ids=["fan", "mooncake"]
)
def test_prefill_tp1_to_decode_tp2_fans_out_only_over_links_that_fan(kind, fans):
    """Over links that fan, the prefill answer names a fan-out of both decode ranks (one
    job, one write); over Mooncake (no Link.fan) each rank is sent on its own, as ever.
    Every decode rank verifies every byte it holds; every pool comes back."""
    memory.register()
    own = TransportSettings(own=(memory.MemorySettings(fan=True),)) if fans else TransportSettings()
    prefill = PrefillServer(
        PrefillConfig(
            pool=_pool(),
            bootstrap_bind="tcp://127.0.0.1:*",
            transports=(kind,),
            transport_settings=own,
            dead_after_s=DEAD_AFTER_S,
            stream_layers="off",
            transfer=TransferConfig(mode="direct"),  # (as cuda-ipc always is: a fan-out writes direct)
        )
    )
    decodes = [
        DecodeServer(
            DecodeConfig(
                pool=_pool(2, rank),
                bootstrap_addr=prefill.bootstrap_endpoint,
                transports=(kind,),
                dead_after_s=DEAD_AFTER_S,
            )
        )
        for rank in range(2)
    ]
    try:
        out = _request(prefill, decodes, 11, np.arange(300) % 97)
        assert out["prefill"]["state"] == "SUCCESS" and out["prefill"]["destinations"] == 2, out["prefill"]
        assert out["prefill"]["fanout"] == (2 if fans else 0) and out["prefill"]["transport"] == kind
        for i in range(2):
            assert out[i]["state"] == "SUCCESS" and out[i]["verified"], out[i]
        if fans:
            assert prefill.endpoint.transports[0].fanout.started == [2]
        for server in (prefill, *decodes):
            assert server.available() == HybridPool(server.pool.config).available()
    finally:
        for d in decodes:
            d.close()
        prefill.close()
