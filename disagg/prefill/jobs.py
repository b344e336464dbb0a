"""What a prefill server runs on a decode peer's transfer workers (its shard of threads):
preparing a request's send while the engine computes, and sending it.

    table: allocated (pages known) --_prepare--> peer shard: _prepare_send --> Destination.prepared
    table: KV computed (or streaming) --_submit--> peer shard: _transfer --> KVSender.send
           (takes the prepared send if it fits) --> table.finished --> TransferDone

The shard is FIFO: a destination's prepare job is queued before its transfer job, so the
transfer job waits for it (Destination.take_prepared) without deadlock. Both jobs look at
the request first: one aborted while they queued plans nothing.
"""

import logging
import time

from disagg.control.messages import TransferDone, TransferStarted
from disagg.control.io import RouterIO
from disagg.errors import DisaggError, ProtocolError
from disagg.prefill.destinations import Destination
from disagg.prefill.peers import DecodePeers
from disagg.prefill.requests import PrefillRequest, RequestTable
from kvpool import HybridPool, KVPoolError
from transfer.errors import WritesAbandoned
from transfer.peer import RemotePool
from transfer.sender import KVSender

log = logging.getLogger(__name__)


class TransferJobs:
    """Mixed into PrefillServer: the effects its RequestTable asks for that run on workers."""
    epoch: int
    io: RouterIO
    peers: DecodePeers
    pool: HybridPool
    requests: RequestTable
    sender: KVSender

    def _may_stream(self, r: PrefillRequest) -> bool:
        """`auto` streams only over a link that leaves the compute alone (not Mooncake TCP from a
        CUDA pool); the table asks before it starts a worker while the engine computes."""
        peers = [self.peers.get(d.peer) for d in r.dests.values()]
        return not r.stream_auto or all(p is None or self.sender.streams_well(p.target) for p in peers)

    def _submit(self, r: PrefillRequest, d: Destination) -> str | None:
        peer = self.peers.get(d.peer)
        if peer is None:
            return "decode peer is not registered"
        try:
            peer.workers.submit(self._transfer, r, d)
        except RuntimeError as exc:  # shut down (closing, or the peer was dropped)
            return str(exc)
        return None

    def _prepare(self, r: PrefillRequest, d: Destination) -> None:
        peer = self.peers.get(d.peer)
        if peer is None:
            return
        stage = self.sender.can_stage(peer.target, d.slots, peer.relay)
        try:
            d.prepared = peer.workers.submit(self._prepare_send, r, peer.target, d, stage)
        except RuntimeError:   # shut down: the transfer worker would not run either
            pass

    def _prepare_send(self, r: PrefillRequest, target: RemotePool, d: Destination, stage: bool):
        """(a transfer worker) d's send laid out; nothing if r ended while the job queued."""
        if r.phase.ended:
            return None
        return self.sender.prepare(target, r.src, d.dst, len(r.tokens), False, stage)

    # ---- a transfer worker -------------------------------------------------------------------
    def _transfer(self, r: PrefillRequest, d: Destination) -> None:
        """Send r's KV (our share of destination d's); the table tells d, and frees the pages
        once every destination is done (or r failed)."""
        ok, reason, done, settled = False, "", None, True
        try:
            peer = self.peers.get(d.peer)
            if peer is None:
                raise ProtocolError("decode peer is not registered")
            if not r.streamed and r.phase.sending:   # (streamed: the table says so once computed;
                # aborted while queued: send() stops before it plans)
                self.io.send(d.peer, TransferStarted(r.room, self.epoch))
            t0 = time.perf_counter()
            report = self.sender.send(peer.target, self.pool.index_set(r.kv), d.dst, r.room, d.slots, peer.relay,
                                      stopped=lambda: not r.phase.sending, progress=r.progress if r.streamed else None,
                                      num_tokens=r.kv.num_tokens, prepared=d.take_prepared())
            ms = (time.perf_counter() - t0) * 1e3
            d.report = {"bytes": report.nbytes, "mode": report.mode.value, "transport": report.transport,
                        "ranges": report.ranges, "transfer_ms": ms, "streamed": report.streamed,
                        "layer_groups": report.groups, "first_write_at": report.first_write_at,
                        "transfer_cpu_ms": report.cpu_ms, "prepared_ahead": report.prepared_ahead,
                        "prepare_ms": report.prepare_ms,
                        # what decode waits for once compute is over: the part of the send not hidden
                        "after_compute_ms": max(0.0, (time.time() - r.timings["prefill_done_at"]) * 1e3),
                        # wall clock the send ended: the router's control phase starts at the
                        # latest one of any rank (router/phases.py), never at a duration's start
                        "transfer_end_at": time.time()}
            done = TransferDone(r.room, self.epoch, True, "", report.nbytes, report.mode.value, report.ranges, ms)
            ok = True
        except (DisaggError, KVPoolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            settled = not isinstance(exc, WritesAbandoned)
            log.warning("room %d: transfer failed: %s", r.room, exc)
        finally:
            self.requests.finished(r, ok, reason, done, settled, d)
