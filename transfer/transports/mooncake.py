"""The Mooncake transport: the only module that imports mooncake.

- P2P handshake (no metadata server); protocol "tcp" or "rdma"; optional RDMA device names.
- The offer's blob holds the Mooncake session ("host:port") and the base address and size of
  each exposed region; a link turns (region, offset) into the addresses Mooncake wants.
- Receive lanes (TCP): Mooncake's TCP transport moves every byte an engine sends or receives
  on one thread of that engine (its io_context, 64 KiB reads), so N writers into one engine
  take turns on one core: eight prefill ranks into one decode rank took 41.5 ms for 64 MiB
  against 21.3 ms for one writer (2 vCPUs; issue 40). A transport therefore runs `engines`
  engines (each its own thread, handshake port and data port), registers every region in each,
  and offers every engine's session; a link on lane L sends through our engine L mod ours and
  lands in the peer's engine L mod theirs. The sender picks the lane (transfer.sender: its TP
  rank plus the receiver's), so the N senders of one receiver land on N different engines
  and one sender's M receivers leave from M of its own. RDMA moves bytes in the NIC: one engine.
- Restarted peers: an engine keeps what it learnt of a peer session ("host:port") for its
  life: the segment (the peer's data port and regions) and pooled data connections, keyed by
  (host, data port), that it reuses without checking. A peer that died and whose ports a new
  process took (same host, after TIME_WAIT; a restarted decode on a fixed host, or any two
  of the suite's hundreds of loopback peers) met stale state: writes read EOF where the
  ack should be (reproduced with four ports to pick from). Two remedies, one per cache:
  - every offer carries its transport's incarnation (random at start); an engine that wrote
    to another incarnation at a session never writes there again: the link leaves from one
    of ours that did not, or from a spare engine started for it (offered to no one);
  - a range that fails is submitted again, up to once per pooled connection Mooncake keeps
    per peer (MC_TCP_LANES_PER_PEER, 4): each stale one fails once and is dropped, then a
    fresh one opens (as HTTP clients retry an idempotent request on a reused keep-alive
    connection that the server had closed). A dead peer fails each try at once (its
    connects are refused); a frozen one leaves ranges pending, never failed.
- Queue limits: a per-peer budget keeps <= max_inflight_per_peer ranges in flight across all
  threads (Mooncake rejects writes with -1 once about 2048 are queued for one peer).
- Every non-zero return code becomes a typed exception (transfer.errors) naming the peer,
  the byte count and the code.
- Writes never spin. Mooncake's batch waits (batch_transfer_sync_write,
  get_batch_transfer_status) busy-poll in C++, one core per waiting thread; on a 2-core host
  that starves the engine's own TCP threads (measured: 1.4 GB/s vs 2.5 GB/s for one 256 MiB
  write). So each range is submitted as a one-entry batch (transfer_submit_write) and retired
  with transfer_check_status (task 0 only; it frees the batch), sleeping between polls.
  The sleep doubles from 100 us to 1 ms while a poll retires nothing, and starts over once
  one does: a 16 MiB staged chunk lands in one range after 10-50 ms, and eight of them
  polled every 100 us (TP 1 -> 8: one prefill process writes eight shares) took 88-116 ms
  of the sender's CPU against 60 ms at 1 ms, on the two cores its engine's TCP threads need.
  A write's life (MooncakeWrite; MooncakePrepared holds the addresses of one prepared ahead):

    prepare: (region, offset) -> addresses, checked     start: submit what the peer's budget
    poll / wait: retire landed ranges (budget back),           grants now, the rest as earlier
                 submit more; the first failure stops          ranges retire
                 submitting, drains, then raises
- A frozen peer (SIGSTOP, a hung host) leaves Mooncake's tasks pending for as long as it is
  frozen: its progress timeout drops the connection but the status stays "pending" (measured:
  40 of 64 ranges still pending 40 s after the freeze; they fail within 0.2 s of a thaw). So
  the liveness layer decides: closing a link (peer dropped or re-registered) abandons its
  writes. Their waiters get WritesAbandoned at once and nothing more is submitted; what is
  already in the engine goes to the transport's reaper, which keeps retiring it and returns
  the peer's budget as it ends (a thawed peer is not starved by its own stale writes).
  What an abandoned range may still do is read its source and land in the lost peer's pages
  of failed requests: decode keeps those quarantined until prefill's answer is settled
  (docs/contract.md, "When things fail").
- Late bytes (TCP): a write that failed, abandoned or not, may still land. Mooncake closes the
  connection of a range it gives up on, but the kernel keeps sending what that socket held
  (an orphan: closed, still retransmitting, for over 100 s) and the peer's engine reads it
  into the range's destination (transports/proc_tcp.py has the measurement). So `unsettled`
  counts, beside the reaper's writes, the orphans toward every host we linked to that still
  hold unacknowledged bytes or FIN, and our own data sockets whose sender closed with bytes
  we have not read yet: prefill says settled, and decode reuses the pages, only when none is
  left on either side.
"""

import argparse
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from transfer.errors import (
    EngineInitError,
    PeerUnreachable,
    RegistrationError,
    TransportError,
    WriteFailed,
    WritesAbandoned,
)
from transfer.flag_values import number
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, PreparedWrite, Transport
from transfer.transports.kind import TransportKind, TransportSettings
from transfer.transports.proc_tcp import Address, listening_ports, orphans_toward, sockets, unread_after_close
from transfer.transports.listeners import hurry_listener
from transfer.transports.ranges import LaneRuns, Ranges, RunSet, check_ranges
from transfer.transports.reaper import Reaper

log = logging.getLogger(__name__)

KIND = "mooncake"
PROTOCOLS = ("tcp", "rdma")
# Measured with Mooncake TCP on a 2-vCPU machine (docs/contract.md, "Figures behind the defaults").
TCP_COST = LinkCost(per_range_us=28.0, link_gbps=2.2)
_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "WARNING",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
}


# Engines of a TCP transport unless told (module docstring: receive lanes). Four: eight
# senders into one decode rank then share its four threads (41.5 ms -> 28.9 ms for 64 MiB).
ENGINES_TCP = 4
LANES_PER_PEER = 4  # Mooncake TCP's pooled connections per peer unless MC_TCP_LANES_PER_PEER says
MAX_LANES = 64  # sessions an offer may name (an offer is untrusted); engines of a transport, spares too


class _Blob(msgspec.Struct, frozen=True, array_like=True):
    session: str  # Mooncake session "host:port" of engine 0 (lane 0; all an older peer reads)
    regions: list[tuple[int, int]]  # (base address, nbytes) per exposed region
    lanes: list[str] = []  # the sessions of engines 1.. (an older peer offers none)
    incarnation: int = 0  # the offering transport's, random at its start (0: an older peer, unknown)

    @property
    def sessions(self) -> list[str]:
        return [self.session, *self.lanes]


_blob_decoder = msgspec.msgpack.Decoder(_Blob)


# ---- one write (the module docstring says why it works this way) ----


class PeerBudget:
    """Counts ranges in flight to one peer, across threads."""

    def __init__(self, limit: int):
        self.limit, self.inflight = limit, 0
        self._lock = threading.Lock()

    def try_acquire(self, n: int) -> int:
        """Take up to `n` units; returns how many were granted (maybe 0)."""
        with self._lock:
            granted = max(0, min(n, self.limit - self.inflight))
            self.inflight += granted
            return granted

    def release(self, n: int) -> None:
        with self._lock:
            self.inflight -= n


class MooncakeWrite(PendingWrite):
    """Ranges submitted one engine batch each as the peer's budget allows, retired in order.
    A range that fails is submitted again, up to `retries` times (each of the peer's pooled
    connections may be one its far end had closed: the module docstring, "Restarted peers");
    a failure beyond that, or any other, stops submitting, drains what is in flight, then
    raises."""

    POLL_INTERVAL_S = 100e-6  # the first sleep, and the sleep after a poll that retired a range
    POLL_MAX_S = 1e-3  # the longest: doubled up to it while polls retire nothing

    def __init__(
        self,
        te,
        session: str,
        budget: PeerBudget,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        *,
        retries: int,
    ):
        self._te, self.peer, self._budget, self._retries = te, session, budget, retries
        self._src, self._dst, self._len = src.tolist(), dst.tolist(), length.tolist()
        self.nbytes = int(length.sum()) if len(length) else 0
        self._next = 0  # next range to submit
        self._again: list[int] = []  # ranges that failed, to submit again (before _next)
        self._failed: dict[int, int] = {}  # range -> its failures so far (beyond `retries`: the write fails)
        self._retired = 0  # ranges retired so far (wait's backoff starts over when it grows)
        self._inflight: deque[tuple[int, int]] = deque()  # (batch id, range), in submission order
        self._failure: tuple[int, str] | None = None
        self._lock = threading.Lock()  # the owner's polls and the reaper's
        self._abandoned = False
        self.pump()

    @property
    def ended(self) -> bool:
        """Nothing of this write is in the engine any more (landed, failed or never submitted)."""
        return not self._inflight and (self._abandoned or self._failure is not None or not self._unsubmitted)

    @property
    def _unsubmitted(self) -> int:
        return len(self._src) - self._next + len(self._again)

    def abandon(self) -> None:
        """The peer is gone: submit nothing more; waiters get WritesAbandoned at once."""
        with self._lock:
            self._abandoned = True

    def pump(self) -> None:
        """Retire what ended (returning budget), then submit what the budget allows."""
        with self._lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        te = self._te
        while self._inflight:  # retire finished ranges in submission order
            batch, i = self._inflight[0]
            code = te.transfer_check_status(batch)
            if code == 0:
                break
            self._inflight.popleft()
            self._retired += 1
            self._budget.release(1)
            if code == 1 or self._failure is not None:
                continue
            tries = self._failed[i] = self._failed.get(i, 0) + 1
            if code == -1 and tries <= self._retries:  # again, on another connection
                self._again.append(i)
                log.debug("mooncake: a range to %s failed (%d time(s)); submitted again", self.peer, tries)
            else:
                self._failure = (code, "timed out" if code == -2 else f"failed {tries} time(s)")
        if self._abandoned or self._failure is not None or not self._unsubmitted:
            return
        granted = self._budget.try_acquire(self._unsubmitted)
        used = 0
        while used < granted:
            if self._again:
                i = self._again.pop()
            else:
                i, self._next = self._next, self._next + 1
            batch = te.transfer_submit_write(self.peer, self._src[i], self._dst[i], self._len[i])
            used += 1
            if batch <= 0:  # refused at submission (dead session, unknown peer)
                self._failure = (int(batch), "was refused")
                self._budget.release(1)
                break
            self._inflight.append((batch, i))
        self._budget.release(granted - used)

    def poll(self) -> bool:
        if self._abandoned:
            raise WritesAbandoned(
                "write",
                -1,
                self.peer,
                self.nbytes,
                detail="the link was closed (peer lost or re-registered); the write was abandoned",
            )
        self.pump()
        if self._inflight or (self._failure is None and self._unsubmitted):
            return False
        if self._failure is not None:
            code, what = self._failure
            raise WriteFailed("write", code, self.peer, self.nbytes, detail=f"a range {what}")
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Poll until every range landed, sleeping between polls (the module docstring says how long)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval, retired = self.POLL_INTERVAL_S, self._retired
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise WriteFailed("write", -2, self.peer, self.nbytes, detail=f"not done within {timeout} s")
            if self._retired != retired:
                interval, retired = self.POLL_INTERVAL_S, self._retired
            time.sleep(interval)
            interval = min(2 * interval, self.POLL_MAX_S)


class MooncakePrepared(PreparedWrite):
    """Ranges checked and turned into addresses; start() submits them."""

    def __init__(self, link: "MooncakeLink", src: np.ndarray, dst: np.ndarray, length: np.ndarray):
        self._link, self._args = link, (src, dst, length)
        self.nbytes = int(length.sum()) if len(length) else 0

    def start(self) -> MooncakeWrite:
        if self._args is None:
            raise RuntimeError("a prepared write starts once")
        args, self._args = self._args, None
        return self._link._start(*args)


class MooncakeExposure(Exposure):
    def __init__(self, transport: "MooncakeTransport", regions: Sequence[tuple[int, int]]):
        self._transport = transport
        self.bases = np.array([int(p) for p, _ in regions], dtype=np.int64)
        self.sizes = np.array([int(n) for _, n in regions], dtype=np.int64)
        self._registered = transport._register(regions)

    def offer(self) -> Offer:
        first, *more = self._transport.sessions
        regions = [(int(p), int(n)) for p, n in zip(self.bases, self.sizes)]
        blob = _Blob(first, regions, more, self._transport.incarnation)
        return Offer(KIND, self._transport.host, msgspec.msgpack.encode(blob))

    def close(self) -> None:
        if self._registered:
            self._transport._unregister(self._registered)
            self._registered = []


class MooncakeLink(Link):
    kind = KIND
    ordered = False  # ranges of one write land in any order; a later write must wait

    def __init__(self, transport: "MooncakeTransport", local: MooncakeExposure, blob: _Blob, engine: int, peer: str):
        """`engine`: ours it leaves from; `peer`: the session of the peer's engine it lands in."""
        self._transport, self._local = transport, local
        self.engine, self.peer = engine, peer
        self._te = transport.engines[engine]
        self._bases = np.array([p for p, _ in blob.regions], dtype=np.int64)
        self._sizes = np.array([n for _, n in blob.regions], dtype=np.int64)
        self.cost = transport.cost
        # TCP reads a CUDA pool through host copies that contend with the engine's kernels
        # (measured, H100: +20% prefill compute while streaming); RDMA reads GPU memory directly
        self.overlaps_gpu_compute = transport.protocol == "rdma"
        self._writes: weakref.WeakSet[MooncakeWrite] = weakref.WeakSet()  # (a waiter holds each)
        self._lock = threading.Lock()
        self._closed = False

    def write_async(self, ranges: Ranges) -> MooncakeWrite:
        return self._prepare(ranges).start()

    def prepare_runs(self, runsets: Sequence[RunSet | LaneRuns]) -> MooncakePrepared:
        return self._prepare(Ranges.concat([r.flatten() for r in runsets]))

    def _prepare(self, ranges: Ranges) -> MooncakePrepared:
        check_ranges("source", ranges.src_region, ranges.src_off, ranges.length, self._local.sizes)
        check_ranges(f"destination {self.peer}", ranges.dst_region, ranges.dst_off, ranges.length, self._sizes)
        return MooncakePrepared(
            self,
            self._local.bases[ranges.src_region] + ranges.src_off,
            self._bases[ranges.dst_region] + ranges.dst_off,
            ranges.length,
        )

    def _start(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> MooncakeWrite:
        if self._closed:
            raise PeerUnreachable("write", -1, self.peer, int(length.sum()), detail="the link is closed")
        write = MooncakeWrite(
            self._te, self.peer, self._transport._budget(self.peer), src, dst, length, retries=self._transport.retries
        )  # (submits its first ranges: outside the lock, writers in parallel)
        with self._lock:
            closed = self._closed
            if not closed:
                self._writes.add(write)
        if closed:  # closed while it was submitting: abandoned like the others
            write.abandon()
            self._transport.reaper.add(write)
        return write

    def probe(self) -> None:
        code = self._te.send_probe(self.peer)
        if code != 0:
            raise PeerUnreachable("probe", code, self.peer)

    def close(self) -> None:
        """Abandon the writes in flight (the module docstring says why); Mooncake keeps one
        session per peer for the engine's life, so nothing else is per link."""
        with self._lock:
            self._closed = True
            writes = [w for w in self._writes if not w.ended]
            self._writes = weakref.WeakSet()
        for w in writes:
            w.abandon()
            self._transport.reaper.add(w)


@contextlib.contextmanager
def _start_up_lines() -> Iterator:
    """Keep what Mooncake prints to stderr while it starts (every run says "Logging before
    InitGoogleLogging", "No RDMA devices found" on TCP, "Local segment descriptor not found":
    expected, and noise at the default log level). The lines go to our DEBUG log, and into the
    error if the start fails. With this module's log level at DEBUG (`--log-level debug`) they
    go to stderr as they come."""
    if log.isEnabledFor(logging.DEBUG):
        yield lambda: []
        return
    with tempfile.TemporaryFile() as kept:
        saved = os.dup(2)
        os.dup2(kept.fileno(), 2)
        lines: list[str] = []
        try:
            yield lambda: lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            kept.seek(0)
            lines += [l for l in kept.read().decode(errors="replace").splitlines() if l.strip()][-20:]
            for line in lines:
                log.debug("mooncake: %s", line)


class MooncakeTransport(Transport):
    kind = KIND

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_names: str = "",
        max_inflight_per_peer: int = 1024,
        progress_timeout_s: int | None = 5,
        engines: int = 0,
    ):
        """`engines`: receive lanes (the module docstring); 0: ENGINES_TCP on tcp, 1 on rdma."""
        engines = engine_count(protocol, engines)
        if max_inflight_per_peer < 1:
            raise ValueError("max_inflight_per_peer must be >= 1")
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if progress_timeout_s is not None:  # a frozen peer fails a write in seconds, not 30 s
            os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(progress_timeout_s))
        self.host, self.protocol, self._device_names = host, protocol, device_names
        # a failed range is submitted again up to once per pooled connection Mooncake keeps per
        # peer: after a restart on a dead peer's data port each of them fails once, then is dropped
        self.retries = _lanes_per_peer()
        self.incarnation = secrets.randbits(63) | 1  # in every offer: a restart at our sessions is another
        self._lock = threading.Lock()
        self._pid = os.getpid()  # (a forked child must not hurry its parent's listeners)
        self._hurried = False  # (close hurried the engines' handshake listeners)
        self.engines: list = []  # the offered ones, then spares
        self._met: list[dict[str, int]] = []  # per engine: session -> the incarnation it wrote to there
        self._data_ports: set[int] = set()  # our engines' listening ports (TCP: where peers' bytes arrive)
        self._peer_hosts: set[Address] | None = set()  # hosts we linked to (None: one unresolved)
        for _ in range(engines):
            self._add(self._start())
        self.offered = engines  # engines[:offered] are offered (one session each)
        self.sessions = [f"{host}:{te.get_rpc_port()}" for te in self.engines]
        self.session_id = self.sessions[0]
        log.info(
            "mooncake: %d engine(s), handshake ports %s, and as many TCP data ports, listen on every address "
            "of this host, whatever the host given (%s): Mooncake binds no single address; only a "
            "NetworkPolicy or a firewall restricts them (all in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, default "
            "15000-17000; docs/security.md)",
            engines,
            ", ".join(s.rpartition(":")[2] for s in self.sessions),
            host,
        )
        self.cost = TCP_COST
        self.max_inflight_per_peer = max_inflight_per_peer
        self._budgets: dict[str, PeerBudget] = {}
        self._registered: dict[int, int] = {}
        self.reaper = Reaper(name="kv-mooncake-reaper")

    def _start(self):
        """A started engine; the ports it opened join our data ports (a port another thread
        opened meanwhile too: counted in `unsettled`, that errs on the safe side)."""
        from mooncake.engine import TransferEngine  # imported late: the env must be set first

        host, protocol = self.host, self.protocol
        before = listening_ports()
        with _start_up_lines() as said:
            te = TransferEngine()
            code = te.initialize(host, "P2PHANDSHAKE", protocol, self._device_names)
        if code != 0:
            raise EngineInitError("initialize", code, detail=f"host={host} protocol={protocol}: {' | '.join(said())}")
        self._data_ports |= listening_ports() - before
        return te

    def expose(self, regions: Sequence[tuple[int, int]]) -> MooncakeExposure:
        return MooncakeExposure(self, regions)

    def connect(self, offer: Offer, local: Exposure, lane: int = 0) -> MooncakeLink:
        if offer.kind != KIND or not isinstance(local, MooncakeExposure):
            raise TransportError(f"mooncake cannot connect a {offer.kind} offer")
        try:
            blob = _blob_decoder.decode(offer.blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransportError(f"malformed mooncake offer: {exc}") from None
        bad = next((s for s in blob.sessions if not _is_session(s)), None)
        if bad is not None or any(p <= 0 or n <= 0 for p, n in blob.regions):
            raise TransportError(f"malformed mooncake offer (session {bad or blob.session!r})")
        if len(blob.sessions) > MAX_LANES:
            raise TransportError(f"malformed mooncake offer ({len(blob.sessions)} sessions, at most {MAX_LANES})")
        peer = blob.sessions[lane % len(blob.sessions)]
        self._met_host(peer.rpartition(":")[0])
        return MooncakeLink(self, local, blob, self._engine_to(peer, blob.incarnation, lane % self.offered), peer)

    def _met_host(self, host: str) -> None:
        """Remember `host` (a session's, as offered) among those our bytes may be on their way to."""
        found = _addresses(host)
        with self._lock:
            if found is None or self._peer_hosts is None:
                self._peer_hosts = None
            else:
                self._peer_hosts |= found

    def _engine_to(self, peer: str, incarnation: int, preferred: int) -> int:
        """The engine a link to `peer` (a session of that incarnation) leaves from: `preferred`
        unless it wrote to another incarnation at that session (module docstring: restarted
        peers), then any engine that did not, else a spare started for it."""
        with self._lock:
            for e in (preferred, *range(len(self.engines))):
                # (a process has one incarnation: A then 0 at a session, or 0 then A, is a
                # restart too; only 0 then 0, two older peers, cannot be told apart)
                if self._met[e].setdefault(peer, incarnation) == incarnation:
                    return e
            if len(self.engines) >= MAX_LANES:
                raise TransportError(
                    f"mooncake: {peer} restarted more often than this process has engines for "
                    f"({MAX_LANES}); restart this process"
                )
            self._add(self._spare())
            self._met[-1][peer] = incarnation
            log.warning(
                "mooncake: %s is a restarted peer (another incarnation wrote to there before); "
                "its writes leave from spare engine %d, whose session cache has never seen it",
                peer,
                len(self.engines) - 1,
            )
            return len(self.engines) - 1

    def _spare(self):
        """An engine for writes only (no offer names it), holding every region registered (lock held)."""
        te = self._start()
        if self._registered:
            code = te.batch_register_memory(list(self._registered), list(self._registered.values()))
            if code != 0:
                hurry_listener(te.get_rpc_port())  # (it goes now)
                raise RegistrationError("batch_register_memory", code, nbytes=sum(self._registered.values()))
        return te

    def _add(self, te) -> None:
        self.engines.append(te)
        self._met.append({})

    # ---- memory (the engine refuses registering one address twice; exposures may overlap) ----
    def _register(self, regions: Sequence[tuple[int, int]]) -> list[int]:
        """Register what is not registered yet; returns the addresses newly registered."""
        fresh = []
        with self._lock:
            for p, n in ((int(p), int(n)) for p, n in regions):
                if n <= 0:
                    raise RegistrationError("register", -1, detail="a region has length 0")
                if p in self._registered:
                    if self._registered[p] != n:
                        raise RegistrationError("register", -7, detail=f"{p:#x} already registered with another length")
                    continue
                fresh.append((p, n))
            for i, te in enumerate(self.engines if fresh else ()):
                code = te.batch_register_memory([p for p, _ in fresh], [n for _, n in fresh])
                if code != 0:
                    for done in self.engines[:i]:
                        done.batch_unregister_memory([p for p, _ in fresh])
                    raise RegistrationError("batch_register_memory", code, nbytes=sum(n for _, n in fresh))
            self._registered.update(fresh)
        return [p for p, _ in fresh]

    def _unregister(self, ptrs: Sequence[int]) -> None:
        with self._lock:
            unknown = [p for p in ptrs if p not in self._registered]
            if unknown:
                raise RegistrationError("unregister", -3, detail=f"address {unknown[0]:#x} was never registered")
            codes = [te.batch_unregister_memory(list(ptrs)) for te in self.engines]
            code = next((c for c in codes if c != 0), 0)
            if code != 0:
                raise RegistrationError("batch_unregister_memory", code)
            for p in ptrs:
                del self._registered[p]

    def unsettled(self) -> int:
        """Writes given up on that are still in our engines (the reaper's), and on TCP the
        sockets still carrying bytes nobody waits for (module docstring: late bytes)."""
        if self.protocol != "tcp":
            return len(self.reaper)
        with self._lock:
            hosts = None if self._peer_hosts is None else set(self._peer_hosts)
        table = list(sockets())  # (the kernel's tables read once for both questions)
        leaving = orphans_toward(hosts, table) if hosts != set() else 0
        return len(self.reaper) + leaving + unread_after_close(self._data_ports, table)

    def close(self) -> None:
        """Stop the reaper, and hurry every engine's handshake listener so that destroying the
        engine (whenever its last reference goes) takes milliseconds, not a second with the GIL held
        (transfer/transports/listeners.py says why)."""
        self.reaper.stop()
        self._hurry_listeners()

    def __del__(self) -> None:  # (a transport dropped unclosed: its engines go next)
        with contextlib.suppress(Exception):  # (at interpreter exit, modules may be gone)
            self._hurry_listeners()

    def _hurry_listeners(self) -> None:
        """Once, in the process that started them: every engine's handshake listener hurried
        (transfer.transports.listeners), so the engines' destructors do not wait on accept()."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            engines = [] if self._hurried else list(self.engines)
            self._hurried = True
        for te in engines:
            hurry_listener(te.get_rpc_port())

    def _budget(self, peer: str) -> PeerBudget:
        with self._lock:
            budget = self._budgets.get(peer)
            if budget is None:
                budget = self._budgets[peer] = PeerBudget(self.max_inflight_per_peer)
            return budget


def _lanes_per_peer() -> int:
    try:
        return min(max(int(os.environ.get("MC_TCP_LANES_PER_PEER", LANES_PER_PEER)), 1), MAX_LANES)
    except ValueError:
        return LANES_PER_PEER


def _addresses(host: str) -> set[Address] | None:
    """The addresses of `host` (an address, or a name resolved now), or None if it resolves to none."""
    try:
        return {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        pass
    try:
        return {ipaddress.ip_address(info[4][0].partition("%")[0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return None


def _is_session(s: str) -> bool:
    host, _, port = s.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def engine_count(protocol: str, engines: int) -> int:
    """The engines a transport of `protocol` runs when asked for `engines` (0: its default),
    checked: ValueError for a count out of range, TransportError for several on rdma."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"mooncake protocol must be tcp or rdma, got {protocol!r}")
    engines = engines or (ENGINES_TCP if protocol == "tcp" else 1)
    if not 0 < engines <= MAX_LANES:
        raise ValueError(f"mooncake engines must be 1..{MAX_LANES} (0: the protocol's default), got {engines}")
    if protocol == "rdma" and engines > 1:
        raise TransportError(
            f"--mooncake-engines {engines} with --mooncake-protocol rdma: several engines are for tcp "
            "(RDMA moves bytes in the NIC, not on an engine's thread); give 1 or 0"
        )
    return engines


# ---- as the registry sees it (transfer/transports/kind.py) ----


@dataclass(frozen=True)
class MooncakeSettings:
    protocol: str = "tcp"  # tcp or rdma
    rdma_devices: str = ""  # NIC names for rdma ("" = all)
    engines: int = 0  # receive lanes (the module docstring); 0: ENGINES_TCP on tcp, 1 on rdma

    def __post_init__(self) -> None:
        engine_count(self.protocol, self.engines)


def _add_flags(g) -> None:
    g.add_argument(
        "--mooncake-protocol", default=MooncakeSettings.protocol, choices=PROTOCOLS, help="Mooncake's own protocol"
    )
    g.add_argument(
        "--rdma-devices",
        default=MooncakeSettings.rdma_devices,
        metavar="NIC,...",
        help="RDMA NICs for Mooncake, e.g. mlx5_0,mlx5_1 (empty: all)",
    )
    g.add_argument(
        "--mooncake-engines",
        type=_engines,
        default=MooncakeSettings.engines,
        metavar="N",
        help=f"Mooncake engines of this process (tcp: each its own thread and two ports; the senders of "
        f"one receiver land on different ones); 0: {ENGINES_TCP} on tcp, 1 on rdma",
    )


def _engines(text: str) -> int:
    n = number(text, int, "an integer")
    if not 0 <= n <= MAX_LANES:
        raise argparse.ArgumentTypeError(f"expected 0..{MAX_LANES} (0: the protocol's default), got {text!r}")
    return n


def _settings_from(args: argparse.Namespace) -> MooncakeSettings:
    return MooncakeSettings(args.mooncake_protocol, args.rdma_devices, args.mooncake_engines)


def _create(common: TransportSettings, own: MooncakeSettings) -> MooncakeTransport:
    return MooncakeTransport(common.host, own.protocol, own.rdma_devices, engines=own.engines)


MOONCAKE = TransportKind(KIND, _create, MooncakeSettings, _add_flags, _settings_from)
