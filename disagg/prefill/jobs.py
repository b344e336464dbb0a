"""TransferJobs: the effects a prefill's RequestTable asks for outside itself, built with the
collaborators they need and given to the table once (it never calls the server).

    table: pages released             --free-->     prefix cache (keeps what it may) or pool, + admission
    table: a decode rank hears        --tell-->     control socket (TransferStarted, TransferDone)
    table: allocated (pages known)    --prepare-->  peer shard: _prepare_send --> Destination.prepared
    table: KV computed (or streaming) --submit-->   peer shard: _transfer --> KVSender.send (takes the
                                                    prepared send if it fits) --> finished(...)

`finished` is the table's transition the table hands with each job: the worker reports the
end of its send to it, and the table tells decode and frees the pages from there.

The shard is FIFO: a destination's prepare job is queued before its transfer job, so the
transfer job waits for it (take_prepared) without deadlock. Both jobs look at the request
first: one aborted while they queued plans nothing.
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
from transfer.errors import TransferError, WritesAbandoned
from transfer.progress import LayerProgress
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
        shut down: the transfer worker would not run either)."""
        peer = self._peers.get(d.peer)
        if peer is None:
            return None
        stage = self._sender.can_stage(peer.target, self._remote(r, d, peer))
        try:
            return peer.workers.submit(self._prepare_send, r, peer.target, d, stage)
        except RuntimeError:
            return None

    def submit(
        self, r: PrefillRequest, d: Destination, progress: LayerProgress | None, finished: Finished
    ) -> str | None:
        """Start d's send on its peer's shard (`progress`: streamed, the engine still computes);
        its worker reports to `finished`. Returns why it could not start, if it could not."""
        peer = self._peers.get(d.peer)
        if peer is None:
            return "decode peer is not registered"
        try:
            peer.workers.submit(self._transfer, r, d, progress, finished)
        except RuntimeError as exc:  # shut down (closing, or the peer was dropped)
            return str(exc)
        return None

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
        ok, reason, done, settled = False, "", None, True
        try:
            peer = self._peers.get(d.peer)
            if peer is None:
                raise ProtocolError("decode peer is not registered")
            if progress is None and r.phase.sending:  # (streamed: the table says so once computed;
                # aborted while queued: send() stops before it plans)
                self._io.send(d.peer, TransferStarted(r.room, self._epoch))
            report = self._sender.send(
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
            # what decode waits for once compute is over: the part of the send not hidden
            report = msgspec.structs.replace(
                report, after_compute_ms=max(0.0, (time.time() - r.timings["prefill_done_at"]) * 1e3)
            )
            done = TransferDone(r.room, self._epoch, True, report=report, digest=self._digest(r, d))
            ok = True
        except (DisaggError, KVPoolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            settled = not isinstance(exc, WritesAbandoned)
            log.warning("room %d: transfer failed: %s", r.room, exc)
        finally:
            finished(r, ok, reason, done, settled, d)


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
