"""The decode peers of one prefill: registration (version, layout, a transport both sides
have), one link and one transfer-worker shard per peer, and dropping silent peers.

A shard is `transfer_workers` threads per decode peer, so a slow or dead peer stalls only its
own transfers (a fan-out into several peers runs on its first destination's shard:
prefill/jobs.py). Peers are added and dropped by the loop thread; transfer submission reads them
from any thread (a dict read).
"""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from disagg.control.chunk_relay import ChunkRelay
from disagg.control.io import RouterIO
from disagg.control.liveness import Liveness
from disagg.control.layout import LayoutInfo, layout_difference
from disagg.control.messages import RegisterDecode, Registered, Refused, check_version
from disagg.errors import ProtocolError
from transfer.errors import TransferError
from transfer.reshard import receivers
from transfer.sender import KVSender, RemotePool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodePeer:
    target: RemotePool  # the link over the transport picked for this peer
    epoch: int
    relay: ChunkRelay
    workers: ThreadPoolExecutor  # this destination's shard
    tp: tuple[int, int] = (1, 0)  # its instance's TP size, and its rank

    def close(self, wait: bool = False) -> None:
        self.workers.shutdown(wait=wait)
        self.target.link.close()


class DecodePeers:
    def __init__(
        self, sender: KVSender, layout: LayoutInfo, io: RouterIO, transfer_workers: int, dead_after_s: float, epoch: int
    ):
        self.sender, self.layout, self.io = sender, layout, io
        self.transfer_workers, self.epoch = transfer_workers, epoch
        self.liveness = Liveness(dead_after_s)
        self._peers: dict[bytes, DecodePeer] = {}
        self._receivers: dict[int, frozenset[int]] = {}  # decode TP size -> ranks we send to
        self._refusals: dict[str, float] = {}  # reason -> when last logged

    def get(self, identity: bytes) -> DecodePeer | None:
        return self._peers.get(identity)

    def heard(self, identity: bytes) -> bool:
        """A frame came from `identity`; whether it is a registered peer."""
        if identity in self._peers:
            self.liveness.heard(identity)
            return True
        return False

    def same_decode(self, identity: bytes, owners: set[bytes]) -> bool:
        """Whether `identity` speaks for a decode rank that owns a room: an owner's connection,
        or a registered connection of the same decode process (same epoch: it re-registered on
        a new socket). A room no decode has claimed yet (or whose owners are all gone) may be
        ended by any registered decode."""
        peer = self._peers.get(identity)
        if identity in owners:
            return True
        if peer is None:
            return False
        holders = [h for h in map(self._peers.get, owners) if h is not None]
        return not holders or any(h.epoch == peer.epoch for h in holders)

    def _refused(self, reason: str) -> None:
        """A refused registration at WARNING: a decode paired with the wrong model (or TP, or
        transport) is a deployment mistake someone must see; the same reason once a minute
        (a decode's readiness watch tries again every second)."""
        now = time.monotonic()
        if now - self._refusals.get(reason, float("-inf")) >= 60.0:
            self._refusals[reason] = now
            log.warning("refused a decode's registration: %s", reason)

    def register(self, identity: bytes, msg: RegisterDecode) -> Registered | Refused:
        try:
            check_version(msg.version)
            if not msg.tp_rank < msg.tp_size:
                raise ProtocolError(f"decode TP rank {msg.tp_rank} is not a rank of its TP size {msg.tp_size}")
            if msg.layout.model is not None and msg.layout.model.tp_size != msg.tp_size:
                raise ProtocolError(
                    f"decode says TP size {msg.tp_size}, its pool is described at TP size {msg.layout.model.tp_size}"
                )
            diff = layout_difference(prefill=self.layout, decode=msg.layout)
            if diff:
                raise ProtocolError(f"layout mismatch: {diff}")
            target = self.sender.connect(
                msg.transports, msg.layout.buffers, msg.staging, msg.layout.page_size, tp=(msg.tp_size, msg.tp_rank)
            )
        except (ProtocolError, TransferError) as exc:
            self._refused(str(exc))
            return Refused(str(exc))
        old = self._peers.get(identity)
        if old is not None:
            old.target.link.close()  # a new registration (new epoch, new regions): a new link
        workers = (
            old.workers
            if old is not None
            else ThreadPoolExecutor(self.transfer_workers, thread_name_prefix=f"kv-transfer-{target.link.peer}")
        )
        self._peers[identity] = DecodePeer(
            target, msg.epoch, ChunkRelay(self.io, identity), workers, (msg.tp_size, msg.tp_rank)
        )
        self.liveness.heard(identity)
        log.info("decode %s registered (epoch %d, %s)", target.link.peer, msg.epoch, target.link.kind)
        ours = self.sender.shard
        if msg.tp_size != ours.tp_size:
            log.info(
                "decode %s is TP rank %d of %d, we are rank %d of %d: we send it the slices of our heads "
                "that it holds (%d lanes; state slots and the AUX row by slice too)",
                target.link.peer,
                msg.tp_rank,
                msg.tp_size,
                ours.tp_rank,
                ours.tp_size,
                sum(len(l) for l in target.src_lanes.values()),
            )
        elif target.lanes is not None:
            log.info(
                "decode %s keeps pages of %d tokens, ours hold %d: its paged components move by token "
                "(runs end where a page of either side ends)",
                target.link.peer,
                msg.layout.page_size,
                self.layout.page_size,
            )
        return Registered(self.epoch, transport=target.link.kind, may_stage=self._may_stage(target))

    def _may_stage(self, target) -> bool:
        """KVSender.may_stage, or True (decode lends as ever) should working it out fail: the
        registration is answered either way, never left to decode's deadline."""
        try:
            return self.sender.may_stage(target)
        except Exception:  # noqa: BLE001 (a bug in the pairing check must not cost the registration)
            log.exception("decode %s: whether we may stage into it (lending it slots as ever)", target.link.peer)
            return True

    def receivers(self, tp_size: int) -> frozenset[int]:
        """The ranks of a decode instance of `tp_size` that we send some of a request's KV to
        (transfer.reshard.sends: equal sizes rank r only; else those holding any of our units)."""
        known = self._receivers.get(tp_size)
        if known is None:
            cfg = self.sender.endpoint.pool.config
            known = self._receivers[tp_size] = frozenset(
                receivers(cfg.model, self.sender.shard, tp_size, tuple(cfg.components))
            )
        return known

    def drop_silent(self) -> set[bytes]:
        """Drop peers silent for dead_after_s; returns their identities."""
        gone = set(self.liveness.silent())
        for identity in gone:
            peer = self._peers.pop(identity, None)
            if peer is not None:
                log.warning(
                    "decode %s silent for %.0f s: dropping it", peer.target.link.peer, self.liveness.dead_after_s
                )
                peer.close()
        return gone

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close(wait=True)
        self._peers.clear()
