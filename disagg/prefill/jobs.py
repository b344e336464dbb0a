"""TransferJobs: the effects a prefill's RequestTable asks for outside itself, built with the
collaborators they need and given to the table once (it never calls the server).

    table: pages released             --free-->     prefix cache (keeps what it may) or pool, + admission
    table: a decode rank hears        --tell-->     control socket (TransferStarted, TransferDone)
    table: allocated (pages known)    --prepare_all-->  peer shard: _prepare_send --> Destination.prepared
        (one fan-out: once every destination is here, one job on the first's shard: _prepare_fan,
         its future on every destination)
    table: KV computed (or streaming) --submit_all-->
        one job per destination, each on its peer's shard: _transfer --> KVSender.send (takes
            the prepared send if it fits) --> finished(..., d)
        or, as one fan-out (below), one job on the first destination's shard: _fan_transfer
            --> FanOut.send --> finished(..., d) for each destination, in order

`finished` is the table's transition the table hands with each job: the worker reports the
end of each destination's send to it, and the table tells decode and frees the pages from there.

The shard is FIFO: a destination's prepare job is queued before its transfer job, so the
transfer job waits for it (take_prepared) without deadlock. Both jobs look at the request
first: one aborted while they queued plans nothing.

One fan-out (transfer.fanout; issue 40): a request whose KV is computed (not streamed) and goes
to several decode ranks over links of one transport that writes to several peers as one
(Link.fan: cuda-ipc), each destination holding no prefix of its own, is sent by ONE job: planned
once, relaned per rank, written as one launch, waited for once, and then each destination is
reported to `finished` as its own job would have been (its TransferStarted before, TransferDone
with its report and digest; its own error; WritesAbandoned unsettled). Sends to several decode
ranks otherwise run at once, each on its peer's shard; the fan-out puts them on one thread,
which is its point: on one GPU each send alone was ~1 ms of host time under one GIL, eight of
them in turn, where one launch is one. Anything else (one destination, streamed, Mooncake,
links that do not fan, a configured staged mode, a receiver's prefix) goes per destination.
Its sends are laid out while the KV computes as one (prepare_all: once every destination is
here, one job on the first destination's shard: FanOut.prepare plans every receiver and
uploads the one write's table), so that once the KV is computed the fan-out only starts its
write, as a prepared send does. Sends laid out one by one before the fan-out was expected (a
destination came before the others' links were known) are dropped, never waited for; the
fan-out job's own prepare was queued before it on its shard, so it waits for no other job.
"""

import logging
import time
from concurrent.futures import Future

import msgspec

from disagg.control.admission import Admission
from disagg.control.digests import for_destination
from disagg.control.io import RouterIO
from disagg.control.messages import TransferDone, TransferStarted
from disagg.errors import DisaggError, ProtocolError
from disagg.prefill.peers import DecodePeer, DecodePeers
from disagg.prefill.requests import Destination, Finished, PrefillRequest
from kvpool import KVPoolError, RequestKV
from kvpool.cache.prefix import PrefixCache
from transfer.config import Mode
from transfer.errors import TransferError, WritesAbandoned
from transfer.fanout import FanOut, FanOutSend, PreparedFan
from transfer.progress import LayerProgress
from transfer.report import TransferReport
from transfer.sender import KVSender, PreparedSend, RemotePool
from transfer.staging import RemoteSlots

log = logging.getLogger(__name__)

DIGEST_WAIT_S = 60.0  # a send that landed waits at most this for its KV's digest (one pass over the KV)


class TransferJobs:
    def __init__(
        self,
        epoch: int,
        io: RouterIO,
        peers: DecodePeers,
        sender: KVSender,
        admission: Admission,
        cache: PrefixCache | None = None,
    ):
        self._epoch, self._io, self._peers, self._sender, self._admission = epoch, io, peers, sender, admission
        self._pool, self._faults, self._cache = sender.endpoint.pool, sender.endpoint.faults, cache

    # ---- effects the table asks for (under its lock) -----------------------------------------
    def free(self, kv: RequestKV, r: PrefillRequest) -> None:
        """r's pages go: through the prefix cache where it took them from there (which keeps
        the whole pages of r.kept, if any), else back to the pool."""
        if r.hit is not None:
            self._cache.release(kv, r.hit, r.kept)
        else:
            self._pool.free_request(kv)
        self._admission.released()

    def tell(self, peer: bytes, msg: TransferDone | TransferStarted) -> None:
        if not (isinstance(msg, TransferDone) and self._faults.hit("control.drop_done")):
            self._io.send(peer, msg)

    def unsettled(self) -> bool:
        """Bytes this process gave up on may still land somewhere (Transport.unsettled)."""
        return self._sender.endpoint.unsettled() > 0

    def may_stream(self, r: PrefillRequest) -> bool:
        """`auto` streams only over a link that leaves the compute alone (not Mooncake TCP from a
        CUDA pool); the table asks before it starts a worker while the engine computes."""
        peers = [self._peers.get(d.peer) for d in r.dests.values()]
        return not r.stream_auto or all(p is None or self._sender.streams_well(p.target) for p in peers)

    def prepare_all(self, r: PrefillRequest, dests: list[Destination]) -> list[Future | None]:
        """The sends of `dests` (r's destinations not laid out yet) laid out while r's KV is
        computed: a job each on its peer's shard, or, where r will go as one fan-out, one job
        for all of r's destinations once every one is here, on the first one's shard (the same
        future for each). None for one not prepared: no peer, shut down (the transfer worker
        would not run either), or a fan-out still waiting for its other destinations."""
        if self._may_fan(r, dests):
            if not r.complete or len(dests) != len(r.dests):  # (all of them, none laid out alone)
                return [None] * len(dests)
            sends = self._fan_sends(r, dests)
            job = self._prepare_on(dests[0], self._prepare_fan, r, sends) if sends is not None else None
            if job is not None:
                return [job] * len(dests)
        return [self._prepare_one(r, d) for d in dests]

    def _prepare_one(self, r: PrefillRequest, d: Destination) -> Future | None:
        peer = self._peers.get(d.peer)
        if peer is None:
            return None
        stage = self._sender.can_stage(peer.target, self._remote(r, d, peer))
        return self._prepare_on(d, self._prepare_send, r, peer.target, d, stage)

    def _prepare_on(self, d: Destination, job, *args) -> Future | None:
        peer = self._peers.get(d.peer)
        try:
            return peer.workers.submit(job, *args) if peer is not None else None
        except RuntimeError:  # shut down
            return None

    def submit_all(
        self, r: PrefillRequest, dests: list[Destination], progress: LayerProgress | None, finished: Finished
    ) -> tuple[int, str | None]:
        """Start the sends to `dests` (`progress`: streamed, the engine still computes): as one
        fan-out job where they fit one (the module's docstring), else a job per destination on
        its peer's shard; the workers report each destination to `finished`. Returns how many
        of `dests`, in order, were started, and why the next could not be (None: all were)."""
        sends = self._fan_sends(r, dests) if progress is None else None
        if sends is not None:
            refused = self._start(dests[0], self._fan_transfer, r, dests, sends, finished)
            return (0, refused) if refused else (len(dests), None)
        for i, d in enumerate(dests):
            refused = self._start(d, self._transfer, r, d, progress, finished)
            if refused:
                return i, refused
        return len(dests), None

    def _start(self, d: Destination, job, *args) -> str | None:
        """`job` on d's peer's shard; why it could not start, if it could not."""
        peer = self._peers.get(d.peer)
        if peer is None:
            return "decode peer is not registered"
        try:
            peer.workers.submit(job, *args)
        except RuntimeError as exc:  # shut down (closing, or the peer was dropped)
            return str(exc)
        return None

    # ---- the choice of a fan-out ---------------------------------------------------------------
    def _fan_sends(self, r: PrefillRequest, dests: list[Destination]) -> list[FanOutSend] | None:
        """The destinations' sends as one fan-out's, where they fit one (several, every peer
        here, none holding a prefix, a mode that may go direct, links that fan together:
        FanOut.fits); else None."""
        if len(dests) < 2 or not self._direct_may_go() or any(d.prefix_len for d in dests):
            return None
        peers = [self._peers.get(d.peer) for d in dests]
        if any(p is None for p in peers):
            return None
        stopped = lambda: not r.phase.sending  # noqa: E731 (asked before planning and the write)
        sends = [FanOutSend(p.target, d.dst, self._remote(r, d, p), stopped) for d, p in zip(dests, peers)]
        return sends if FanOut.fits(sends) else None

    def _may_fan(self, r: PrefillRequest, dests: list[Destination]) -> bool:
        """Whether r is expected to go as one fan-out (so laying out its sends one by one is
        wasted), from what is known before every destination is: several receivers
        expected, none of `dests` holding a prefix, and each one's link fans."""
        many = r.receivers is not None and len(r.receivers) > 1
        peers = [self._peers.get(d.peer) for d in dests]
        return (
            many
            and self._direct_may_go()
            and not any(d.prefix_len for d in dests)
            and all(p is not None and p.target.link.fan() is not None for p in peers)
        )

    def _direct_may_go(self) -> bool:
        """A fan-out writes direct only: configured staged (or gathered), each send goes alone
        on its own shard (the fan-out would send them one by one, on one thread)."""
        return self._sender.endpoint.config.mode in (Mode.AUTO, Mode.DIRECT)

    def _digest(self, r: PrefillRequest, d: Destination) -> dict[str, bytes]:
        """The digest of the units this rank sent d, as the engine wrote them (disagg.control.digests);
        it is computed beside the sends (PrefillServer._digest): wait for it."""
        cfg = self._pool.config
        try:
            digest = r.digest.result(timeout=DIGEST_WAIT_S)[0] if r.digest is not None else {}
        except Exception as exc:  # noqa: BLE001 (the digest thread's error, or no result in time)
            raise TransferError(f"the KV's digest: {type(exc).__name__}: {exc}") from None
        return for_destination(cfg.model, digest, (cfg.tp_size, cfg.tp_rank), (r.tp_size or 1, d.rank))

    @staticmethod
    def _remote(r: PrefillRequest, d: Destination, peer: DecodePeer) -> RemoteSlots:
        """What a staged send to d writes through: its slots, over the peer's chunk relay."""
        return RemoteSlots(r.room, d.slots, peer.relay)

    # ---- a transfer worker -------------------------------------------------------------------
    def _prepare_fan(self, r: PrefillRequest, sends: list[FanOutSend]) -> PreparedFan | None:
        """r's fan-out laid out (every receiver planned, the one write's table uploaded);
        nothing if r ended while the job queued."""
        if r.phase.ended:
            return None
        return FanOut(self._sender).prepare(r.src, sends, len(r.tokens))

    def _prepare_send(self, r: PrefillRequest, target: RemotePool, d: Destination, stage: bool):
        """d's send laid out; nothing if r ended while the job queued."""
        if r.phase.ended:
            return None
        return self._sender.prepare(target, r.src, d.dst, len(r.tokens), False, stage, prefix_len=d.prefix_len)

    def _transfer(self, r: PrefillRequest, d: Destination, progress: LayerProgress | None, finished: Finished) -> None:
        """Send r's KV (our share of destination d's); `finished` tells d, and frees the pages
        once every destination is done (or r failed)."""
        result = None  # (None: an error not ours, which propagates: d fails without a reason)
        try:
            result = self._send(r, d, progress)
        except (DisaggError, KVPoolError) as exc:
            result = exc
        finally:
            self._settle(r, d, result, finished)

    def _send(self, r: PrefillRequest, d: Destination, progress: LayerProgress | None) -> TransferReport:
        peer = self._peers.get(d.peer)
        if peer is None:
            raise ProtocolError("decode peer is not registered")
        if progress is None and r.phase.sending:  # (streamed: the table says so once computed;
            # aborted while queued: send() stops before it plans)
            self._io.send(d.peer, TransferStarted(r.room, self._epoch))
        return self._sender.send(
            peer.target,
            self._pool.index_set(r.kv),
            d.dst,
            self._remote(r, d, peer),
            stopped=lambda: not r.phase.sending,
            progress=progress,
            num_tokens=r.kv.num_tokens,
            prepared=take_prepared(d),
            prefix_len=d.prefix_len,
        )

    def _fan_transfer(
        self, r: PrefillRequest, dests: list[Destination], sends: list[FanOutSend], finished: Finished
    ) -> None:
        """Send r's KV to every destination as one fan-out (FanOut.send: per receiver its
        report, or its own error); `finished` hears each destination, in order, as its own
        job's would."""
        results: list = [None] * len(dests)  # (None: an error not ours, which propagates)
        try:
            prepared = take_fan(dests)
            if r.phase.sending:  # (aborted while queued: FanOut cancels every receiver before planning)
                for d in dests:
                    self._io.send(d.peer, TransferStarted(r.room, self._epoch))
            src, n = self._pool.index_set(r.kv), r.kv.num_tokens
            results = FanOut(self._sender).send(src, sends, num_tokens=n, prepared=prepared)
        except (DisaggError, KVPoolError) as exc:
            results = [exc] * len(dests)
        finally:
            for d, result in zip(dests, results):
                self._settle(r, d, result, finished)

    def _settle(
        self, r: PrefillRequest, d: Destination, result: TransferReport | BaseException | None, finished: Finished
    ) -> None:
        """d's send ended with `result`: `finished` hears its TransferDone (the report, with
        how long it went on after compute, and d's digest) or why it failed."""
        ok, reason, done, settled = False, "", None, True
        try:
            if isinstance(result, TransferReport):
                # what decode waits for once compute is over: the part of the send not hidden
                after = max(0.0, (time.time() - r.timings["prefill_done_at"]) * 1e3)
                report = msgspec.structs.replace(result, after_compute_ms=after)
                done = TransferDone(r.room, self._epoch, True, report=report, digest=self._digest(r, d))
                ok = True
            elif result is not None:
                reason, settled = _failed(r, result)
        except (DisaggError, KVPoolError) as exc:
            reason, settled = _failed(r, exc)
        finally:
            finished(r, ok, reason, done, settled, d)


def _failed(r: PrefillRequest, exc: BaseException) -> tuple[str, bool]:
    """A destination's send failed with `exc`: the reason decode hears, and whether no write of
    it may still land (WritesAbandoned: the link closed with writes in flight)."""
    log.warning("room %d: transfer failed: %s", r.room, exc)
    return f"{type(exc).__name__}: {exc}", not isinstance(exc, WritesAbandoned)


def take_prepared(d: Destination):
    """d's send as prepared while the KV computed (a KVSender PreparedSend), or None (none was
    asked for, or the job failed: the send plans again and raises what planning raises). The
    job was queued on the peer's FIFO worker shard before the caller's, so a worker has taken
    it by now: waiting for it cannot deadlock, and it is not cancelled (a job taken but not
    yet marked running could still be).
    A fan-out's job (prepare_all laid r out as one, but its destinations went one by one: a
    peer gone meanwhile) is no send of d's: None, and the send plans its own."""
    job, d.prepared = d.prepared, None
    if job is None:
        return None
    try:
        got = job.result()
    except Exception:  # noqa: BLE001
        return None
    return got if isinstance(got, PreparedSend) else None


def take_fan(dests: list[Destination]) -> PreparedFan | None:
    """The fan-out laid out for `dests` while the KV computed (TransferJobs.prepare_all: one
    job, shared by every destination), or None: none, or its job failed (the fan-out plans
    again). The job was queued on the first destination's shard before the caller's, which
    runs there: waiting for it cannot deadlock. Sends laid out one by one instead (before the
    fan-out was expected) are dropped: cancelled if not started, never waited for (one may
    queue behind another peer's jobs, on that peer's shard)."""
    jobs = [d.prepared for d in dests]
    for d in dests:
        d.prepared = None
    if jobs[0] is None or any(j is not jobs[0] for j in jobs):
        for j in jobs:
            if j is not None:
                j.cancel()
        return None
    try:
        got = jobs[0].result()
    except Exception:  # noqa: BLE001
        return None
    return got if isinstance(got, PreparedFan) else None
