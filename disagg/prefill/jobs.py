"""TransferJobs: the effects a prefill's RequestTable asks for outside itself, built with the
collaborators they need and given to the table once (it never calls the server).

    table: pages released             --free-->     prefix cache (keeps what it may) or pool, + admission
    table: a decode rank hears        --tell-->     control socket (TransferStarted, TransferDone)
    table: allocated (pages known)    --prepare-->  peer shard: _prepare_send --> Destination.prepared
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
Its sends are not prepared while the KV computes (prepare() decides from the same facts:
several receivers expected over a link that fans); a send prepared all the same (the decision
changed meanwhile: a peer registered again) is dropped: cancelled if its job has not started,
else left to end and be collected, never waited for. So the fan-out job waits for no other
job, and runs on the first destination's shard without any way to deadlock.
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
from transfer.fanout import FanOut, FanOutSend
from transfer.progress import LayerProgress
from transfer.report import TransferReport
from transfer.sender import KVSender, RemotePool
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

    def may_stream(self, r: PrefillRequest) -> bool:
        """`auto` streams only over a link that leaves the compute alone (not Mooncake TCP from a
        CUDA pool); the table asks before it starts a worker while the engine computes."""
        peers = [self._peers.get(d.peer) for d in r.dests.values()]
        return not r.stream_auto or all(p is None or self._sender.streams_well(p.target) for p in peers)

    def prepare(self, r: PrefillRequest, d: Destination) -> Future | None:
        """d's send laid out on its peer's shard while r's KV is computed (None: no peer, or
        shut down: the transfer worker would not run either; or r will go as one fan-out,
        which plans all of its receivers at once when it sends)."""
        peer = self._peers.get(d.peer)
        if peer is None or self._may_fan(r, d, peer):
            return None
        stage = self._sender.can_stage(peer.target, self._remote(r, d, peer))
        try:
            return peer.workers.submit(self._prepare_send, r, peer.target, d, stage)
        except RuntimeError:
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

    def _may_fan(self, r: PrefillRequest, d: Destination, peer: DecodePeer) -> bool:
        """Whether d's send is expected to go in a fan-out (so laying it out alone is wasted),
        from what is known before every destination is: several receivers expected, d holds
        no prefix, and its link fans. Wrong either way costs only the prepare-ahead."""
        many = r.receivers is not None and len(r.receivers) > 1
        return many and not d.prefix_len and self._direct_may_go() and peer.target.link.fan() is not None

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
            for d in dests:
                drop_prepared(d)
            if r.phase.sending:  # (aborted while queued: FanOut cancels every receiver before planning)
                for d in dests:
                    self._io.send(d.peer, TransferStarted(r.room, self._epoch))
            results = FanOut(self._sender).send(self._pool.index_set(r.kv), sends, num_tokens=r.kv.num_tokens)
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
    yet marked running could still be)."""
    job, d.prepared = d.prepared, None
    if job is None:
        return None
    try:
        return job.result()
    except Exception:  # noqa: BLE001
        return None


def drop_prepared(d: Destination) -> None:
    """d's send prepared while the KV computed, which a fan-out does not use (it plans every
    receiver at once): its job cancelled if it has not started, else left to end and be
    collected (unstarted prepared writes give their tables back when dropped). Never waited
    for: it may queue behind another peer's jobs, on that peer's shard."""
    job, d.prepared = d.prepared, None
    if job is not None:
        job.cancel()
