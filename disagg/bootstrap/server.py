"""Bootstrap: prefill ranks register, decode looks them up. A REP socket; every frame gets a
reply (Refused with a reason for anything invalid) and the server keeps serving.

The ranks registered at one bootstrap are one prefill instance: a rank whose TP size, pool
or model differs from a live rank's is refused (and ranks beyond a new TP size are dropped).
A registration is a lease: prefill takes its rank at start (RegisterPrefill), then renews it
(RenewPrefill) every RENEW_S, and it is live for lease_s after the last renewal; a lookup
answers only a live rank (a lapsed entry is kept for its epoch, never handed out). A live
rank is never taken over: a second instance of it is refused and told who holds it
(LIVE_HOLDER). The rank of a prefill the bootstrap runs inside is held from the start and never
lapses: it lives as long as the bootstrap answers (both are one process; a renewal thread of that
process starved by load must not make decode refuse it). A newer epoch (a restarted prefill) replaces an entry whose lease ran out; an
older epoch is always refused, so a stale process cannot take a rank back.
A restarted bootstrap knows no rank, while the live ranks' leases still run: for grace_s
(a lease and a renewal interval) after its start only renewals take ranks, so each live
rank re-claims its own before a newcomer could (RECLAIMING).
Epochs are start times (ns): one more than EPOCH_SLACK_S ahead of the bootstrap's clock is
refused (a later epoch out-ranks every honest restart, so it could hold a rank until the
clock caught up). No frame ends the loop: a message of more than one frame is refused, and
anything else that goes wrong with one request is logged and refused.
"""

import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from disagg.control.auth import Gate
from disagg.control.messages import (
    MAX_TP_SIZE,
    BootstrapReply,
    BootstrapRequest,
    Decoder,
    Lookup,
    PrefillInfo,
    RegisterPrefill,
    Registered,
    Refused,
    RenewPrefill,
    check_version,
    encoder,
)
from disagg.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

LIVE_HOLDER = "held by a live prefill"  # in a refusal: wait for its lease to run out, or give up
RECLAIMING = "kept for its live holder"  # in a refusal: the bootstrap restarted; wait out its grace period
RENEW_S = 1.0  # a prefill renews its lease this often
LEASE_S = 3.0  # a rank is live this long after its last renewal
EPOCH_SLACK_S = 5.0  # how far ahead of the bootstrap's clock an epoch may be (hosts' clock skew)


@dataclass(frozen=True)
class BootstrapConfig:
    bind: str = "tcp://127.0.0.1:8998"
    lease_s: float = LEASE_S  # a rank is live this long after its prefill last renewed it
    grace_s: float = LEASE_S + RENEW_S  # after a start, only renewals take ranks (a live rank's is due by then)


class BootstrapServer:
    def __init__(self, config: BootstrapConfig, gate: Gate, own: RegisterPrefill | None = None):
        """`own`: the rank of the prefill this bootstrap runs inside, held from the start (it
        started with it, so no live holder of that rank can be waiting to renew)."""
        self.config = config
        self._sock = gate.server(gate.ctx.socket(zmq.REP), "bootstrap")
        try:
            self._sock.bind(config.bind)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ConfigError(
                f"bootstrap {config.bind}: cannot bind ({exc}); if another prefill runs its bootstrap "
                f"there, register with it instead: --bootstrap-bind none --bootstrap-addr "
                f"tcp://HOST:PORT"
            ) from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = Decoder(BootstrapRequest, "bootstrap")
        self.ranks: dict[int, RegisterPrefill] = {}
        self._renewed: dict[int, float] = {}  # rank -> monotonic time of its last registration
        self._started = time.monotonic()
        self._own = own.tp_rank if own is not None else None  # held while we serve: never lapses
        if own is not None:
            self.ranks[own.tp_rank], self._renewed[own.tp_rank] = own, self._started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self, frame: bytes) -> BootstrapReply:
        try:
            msg = self._decoder.decode(frame)
            match msg:
                case RenewPrefill(info=info):
                    return self._register(info, renewal=True)
                case RegisterPrefill():
                    return self._register(msg, renewal=False)
                case Lookup(version=v, tp_rank=rank):
                    check_version(v)
                    return PrefillInfo(self._live(rank))
        except ProtocolError as exc:
            log.warning("bootstrap request refused: %s", exc)
            return Refused(str(exc))
        return Refused("unexpected message")

    def _register(self, msg: RegisterPrefill, renewal: bool) -> Registered:
        """Take or renew a rank (a renewal: its holder, or a live rank re-claiming it from a
        restarted bootstrap); ProtocolError saying why not."""
        rank, size, epoch = msg.tp_rank, msg.tp_size, msg.epoch
        check_version(msg.version)
        if not 1 <= size <= MAX_TP_SIZE:
            raise ProtocolError(f"tp_size {size} outside [1, {MAX_TP_SIZE}]")
        if not 0 <= rank < size:
            raise ProtocolError(f"tp_rank {rank} outside [0, {size})")
        ahead_s = (epoch - time.time_ns()) / 1e9
        if ahead_s > EPOCH_SLACK_S:
            raise ProtocolError(
                f"epoch {epoch} is {ahead_s:.0f} s ahead of this bootstrap's clock (at most "
                f"{EPOCH_SLACK_S:g} s allowed; epochs are start times in ns): sync the hosts' clocks"
            )
        old, now = self.ranks.get(rank), time.monotonic()
        if old is not None and epoch < old.epoch:
            raise ProtocolError(
                f"rank {rank}: epoch {epoch} is older than registered {old.epoch} (held by "
                f"{old.control_endpoint}); only a restarted prefill can take it back"
            )
        if old == msg:  # the holder renews its lease
            self._renewed[rank] = now
            return Registered(epoch)
        age = self._age(rank, now)
        if old is not None and age < self.config.lease_s:
            log.warning(
                "refused %s prefill for rank %d (%s): rank %d is held by %s",
                "a renewing" if renewal else "a second",
                rank,
                msg.control_endpoint,
                rank,
                old.control_endpoint,
            )
            raise ProtocolError(
                f"rank {rank} is {LIVE_HOLDER} at {old.control_endpoint} (epoch {old.epoch}, "
                f"renewed {age:.1f} s ago); stop it first or give this one another --tp-rank"
            )
        up_s = now - self._started
        if not renewal and up_s < self.config.grace_s:
            raise ProtocolError(
                f"rank {rank} is {RECLAIMING}: this bootstrap started {up_s:.1f} s ago and "
                f"waits {self.config.grace_s:g} s for live ranks to renew before a new prefill "
                f"takes one"
            )
        odd = self._odd_rank(msg, now)
        if odd:
            raise ProtocolError(odd)
        self.ranks[rank], self._renewed[rank] = msg, now
        for stale in [r for r in self.ranks if r >= size]:  # of an instance of more ranks before
            del self.ranks[stale], self._renewed[stale]
        log.info(
            "prefill rank %d %s (epoch %d, %s)",
            rank,
            "re-claimed" if renewal else "registered",
            epoch,
            msg.control_endpoint,
        )
        return Registered(epoch)

    def _age(self, rank: int, now: float) -> float:
        """Seconds since `rank` was last renewed (inf: never; 0: the rank of the prefill we run
        inside, live as long as we answer)."""
        if rank == self._own and rank in self.ranks:
            return 0.0
        return now - self._renewed.get(rank, float("-inf"))

    def _live(self, rank: int) -> RegisterPrefill:
        """The holder of `rank` if its lease runs; else ProtocolError. An expired entry is kept
        (its epoch still orders restarts) but never handed out: decode would register with a
        prefill that stopped renewing (dead, frozen or cut off) and wait out its deadline."""
        info = self.ranks.get(rank)
        if info is None:
            raise ProtocolError(f"no prefill rank {rank} registered")
        age = self._age(rank, time.monotonic())
        if age >= self.config.lease_s:
            raise ProtocolError(
                f"prefill rank {rank} ({info.control_endpoint}) stopped renewing its lease "
                f"{age:.1f} s ago: no live prefill holds it"
            )
        return info

    def _odd_rank(self, msg: RegisterPrefill, now: float) -> str | None:
        """Why `msg` cannot be a rank of the instance the live ranks form (the ranks behind one
        bootstrap are one instance: one TP size, one model, one pool layout), or None."""
        for rank, live in self.ranks.items():
            if rank == msg.tp_rank or self._age(rank, now) >= self.config.lease_s:
                continue
            a, b = live.layout, msg.layout
            words = [f"tp_size {live.tp_size} vs {msg.tp_size}"] if live.tp_size != msg.tp_size else []
            if (a.page_size, a.layout) != (b.page_size, b.layout):
                words.append(f"pool {a.page_size}-token pages {a.layout} vs {b.page_size}-token pages {b.layout}")
            if (
                a.model is not None
                and b.model is not None
                and (msgspec.structs.replace(a.model, tp_size=1) != msgspec.structs.replace(b.model, tp_size=1))
            ):
                words.append(
                    f"model {a.model.name} vs {b.model.name}"
                    + (" (alike by name, not by geometry)" if a.model.name == b.model.name else "")
                )
            if words:
                return (
                    f"rank {msg.tp_rank} does not belong with live rank {rank} ({live.control_endpoint}): "
                    f"{'; '.join(words[:4])} (the ranks registered at one bootstrap are one instance)"
                )
        return None

    def serve_forever(self, poll_ms: int = 100) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(poll_ms):
                continue
            frames = self._sock.recv_multipart()  # the whole message: REP must answer before the next
            try:
                reply = (
                    self.handle(frames[0]) if len(frames) == 1 else Refused(f"one frame per request, got {len(frames)}")
                )
            except Exception as exc:  # no request may end the loop
                log.exception("bootstrap request failed")
                reply = Refused(f"internal error: {type(exc).__name__}")
            self._sock.send(encoder.encode(reply))

    def interrupt(self) -> None:
        """Make serve_forever return within one poll (safe from a signal handler: sets a flag)."""
        self._stop.set()

    def start(self) -> "BootstrapServer":
        self._thread = threading.Thread(target=self.serve_forever, name="bootstrap", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sock.close(linger=0)


class Refusal(ProtocolError):
    """The bootstrap answered, and said no (as opposed to not answering)."""


class NoAnswer(ProtocolError):
    """The bootstrap did not answer in time (not up yet, gone, or of another auth key)."""


class BootstrapClient:
    """REQ client with a timeout; a lost reply resets the socket (REQ cannot resend)."""

    def __init__(self, endpoint: str, gate: Gate, timeout_s: float = 5.0):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._gate, self._ctx = gate, gate.ctx
        self._decoder = Decoder(BootstrapReply, "bootstrap reply")
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._gate.client(self._ctx.socket(zmq.REQ), f"bootstrap client of {self.endpoint}")
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ProtocolError(f"bad bootstrap endpoint {self.endpoint!r}: {exc}") from None
        return sock

    def call(self, msg: BootstrapRequest) -> BootstrapReply:
        self._sock.send(encoder.encode(msg))
        if not self._sock.poll(int(self.timeout_s * 1000)):
            self._sock.close()
            self._sock = self._connect()
            raise NoAnswer(
                f"bootstrap {self.endpoint} did not answer within {self.timeout_s:.3g} s (is it "
                f"running, and does it hold this deployment's auth key?)"
            )
        reply = self._decoder.decode(self._sock.recv())
        if isinstance(reply, Refused):
            raise Refusal(f"bootstrap refused: {reply.reason}")
        return reply

    def register(self, info: RegisterPrefill) -> None:
        self.call(info)

    def renew(self, info: RegisterPrefill) -> None:
        self.call(RenewPrefill(info))

    def lookup(self, version: int, tp_rank: int = 0) -> RegisterPrefill:
        reply = self.call(Lookup(version, tp_rank=tp_rank))
        assert isinstance(reply, PrefillInfo)
        return reply.info

    def close(self) -> None:
        self._sock.close()
