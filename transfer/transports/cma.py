"""The CMA transport (Linux cross memory attach): prefill writes straight into a CPU pool of
another process on the same host with process_vm_writev, one copy by the kernel, no socket
or engine in between. For CPU pools only (a vLLM CPU server's KV cache); a peer elsewhere is
reached over the next transport both sides offer (Mooncake).

    decode (owner)                                prefill (writer)
      expose: an abstract unix socket with a        reach_problem / connect: connect to that
      random name; a thread answers each            socket; SO_PEERCRED names the process
      connection with the regions' addresses        that answers (the kernel's word); a pidfd
      offer: host id + the socket's name            follows that process, not its pid number;
                                                    its regions come from it; one byte read
                                                    back checks the kernel lets us
                                                  write: ranges checked against its regions,
                                                    then process_vm_writev, IOV_MAX ranges a
                                                    call, each call only while the process
                                                    lives and the link is open; synchronous:
                                                    nothing is in flight once a write returns

Why a socket and not addresses in the offer: process_vm_writev reaches any process of our
user, so a pid and addresses taken from an offer would let whoever registers point our writes
into any such process. Here the offer carries only a name; the pid is what the kernel says of
the process listening there, and the addresses are what that process itself answers. A forged
offer can name another pool's socket at worst, and the writes then land in that pool's
regions, checked as always: what Mooncake's data port allows (docs/security.md).
The kernel allows the writes where it allows ptrace (same user, or CAP_SYS_PTRACE; Yama's
ptrace_scope 1 refuses unrelated processes), between processes of one network namespace (the
socket) and one PID namespace (the pid); where any of that fails reach_problem says why.
Measured on a 2-vCPU VM: 32 MiB in 5.8 ms (loopback TCP there: 31-69 ms).
"""

import ctypes
import errno
import os
import secrets
import select
import socket
import struct
import sys
import threading
from collections.abc import Sequence

import msgspec
import numpy as np

from transfer.errors import PeerUnreachable, TransportError, WriteFailed
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, PreparedWrite, Transport
from transfer.transports.host import host_identity
from transfer.transports.kind import TransportKind, TransportSettings
from transfer.transports.ranges import LaneRuns, Ranges, RunSet, check_ranges

KIND = "cma"
COST = LinkCost(per_range_us=1.0, link_gbps=5.0)  # module docstring; fragments cost little: direct
IOV_MAX = 1024  # ranges per call (the kernel's UIO_MAXIOV)
ASK_S = 2.0  # an owner answers at once; a socket that stays silent this long is not ours
_PREFIX = b"\0disagg-cma-"  # abstract namespace: nothing on disk, gone with the process
_ANSWER_LIMIT = 1 << 22


class _Blob(msgspec.Struct, frozen=True, array_like=True):
    socket: bytes  # the owner's abstract socket (never an address, never a pid)


class _Answer(msgspec.Struct, frozen=True, array_like=True):
    regions: list[tuple[int, int]]  # (address, nbytes) per exposed region


def _calls():
    """process_vm_writev / process_vm_readv from libc (ctypes lets go of the GIL in them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    for name in ("process_vm_writev", "process_vm_readv"):
        f = getattr(libc, name)
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        f.restype = ctypes.c_ssize_t
        out.append(f)
    return tuple(out)


def _iov(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """struct iovec[n] ({void *base; size_t len}, 64-bit) as one array."""
    return np.ascontiguousarray(np.stack([addr, length], axis=1).astype(np.uint64))


def _refusal(code: int, pid: int) -> str:
    if code == errno.EPERM:
        return f"the kernel does not let this process write pid {pid}'s memory (ptrace access: same user or CAP_SYS_PTRACE; Yama ptrace_scope)"
    if code == errno.ESRCH:
        return f"pid {pid} is gone"
    if code == errno.ENOSYS:
        return "process_vm_writev is not available (seccomp or an old kernel)"
    return f"{os.strerror(code)} (errno {code})"


class CmaExposure(Exposure):
    """Local regions and the socket that tells a writer where they are."""

    def __init__(self, regions: Sequence[tuple[int, int]]):
        self.bases = np.array([int(p) for p, _ in regions], dtype=np.int64)
        self.sizes = np.array([int(n) for _, n in regions], dtype=np.int64)
        self._answer = msgspec.msgpack.encode(_Answer([(int(p), int(n)) for p, n in zip(self.bases, self.sizes)]))
        self.name = _PREFIX + secrets.token_hex(16).encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(64)
        except OSError as exc:
            self._sock.close()
            raise TransportError(f"{KIND}: cannot listen on an abstract unix socket: {exc}") from None
        self._thread = threading.Thread(target=self._serve, name="kv-cma-offer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(ASK_S)
                    conn.sendall(self._answer)
                except OSError:
                    pass  # the asker went away: its problem

    def offer(self) -> Offer:
        return Offer(KIND, host_identity(), msgspec.msgpack.encode(_Blob(self.name)))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=ASK_S)


class _Owner:
    """The process behind an offer, as the kernel names it: a pidfd, and its own regions."""

    def __init__(self, name: bytes):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ASK_S)
            s.connect(name)
            pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            self.pid, self.pidfd = pid, os.pidfd_open(pid)  # (before its answer: the owner is alive)
            try:
                answer = _read_all(s)
                self.regions = msgspec.msgpack.decode(answer, type=_Answer).regions
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.close()
                raise TransportError(f"{KIND}: pid {pid} did not say where its regions are ({exc})") from None
        if any(p <= 0 or n <= 0 for p, n in self.regions):
            self.close()
            raise TransportError(f"{KIND}: pid {pid} answered a malformed region")

    def alive(self) -> bool:
        return self.pidfd >= 0 and not select.select([self.pidfd], [], [], 0)[0]  # readable: it exited

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _read_all(s: socket.socket) -> bytes:
    parts, size = [], 0
    while chunk := s.recv(65536):
        parts.append(chunk)
        size += len(chunk)
        if size > _ANSWER_LIMIT:
            raise OSError("answer too long")
    return b"".join(parts)


class _Done(PendingWrite):
    """A write that landed before start() returned."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def poll(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


class CmaPrepared(PreparedWrite):
    def __init__(self, link: "CmaLink", local: np.ndarray, remote: np.ndarray, nbytes: int):
        self._link, self._iovs, self.nbytes = link, (local, remote), nbytes

    def start(self) -> _Done:
        if self._iovs is None:
            raise RuntimeError("a prepared write starts once")
        iovs, self._iovs = self._iovs, None
        self._link._write(*iovs, self.nbytes)
        return _Done(self.nbytes)


class CmaLink(Link):
    kind = KIND
    cost = COST
    ordered = True  # synchronous: a later write starts after an earlier one landed
    synchronous = True

    def __init__(self, transport: "CmaTransport", local: CmaExposure, owner: _Owner):
        self._t, self._local, self._owner = transport, local, owner
        self.peer = f"pid {owner.pid} on this host"
        self._bases = np.array([p for p, _ in owner.regions], dtype=np.int64)
        self._sizes = np.array([n for _, n in owner.regions], dtype=np.int64)
        self._cond = threading.Condition()
        self._busy, self._closed = 0, False

    def write_async(self, ranges: Ranges) -> _Done:
        return self._prepare(ranges).start()

    def prepare_runs(self, runsets: Sequence[RunSet | LaneRuns]) -> CmaPrepared:
        return self._prepare(Ranges.concat([r.flatten() for r in runsets]))

    def _prepare(self, ranges: Ranges) -> CmaPrepared:
        check_ranges("source", ranges.src_region, ranges.src_off, ranges.length, self._local.sizes)
        check_ranges(f"destination {self.peer}", ranges.dst_region, ranges.dst_off, ranges.length, self._sizes)
        return CmaPrepared(
            self,
            _iov(self._local.bases[ranges.src_region] + ranges.src_off, ranges.length),
            _iov(self._bases[ranges.dst_region] + ranges.dst_off, ranges.length),
            ranges.nbytes,
        )

    def _write(self, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
        """IOV_MAX ranges a call, each only while the link is open and its owner lives (a
        closed link waits for the call in progress, close())."""
        for i in range(0, len(local), IOV_MAX):
            lo, re = local[i : i + IOV_MAX], remote[i : i + IOV_MAX]
            want = int(lo[:, 1].sum())
            self._enter(nbytes)
            try:
                got = self._t.writev(self._owner.pid, lo.ctypes.data, len(lo), re.ctypes.data, len(re), 0)
                code = ctypes.get_errno() if got < 0 else 0
            finally:
                self._leave()
            if got < 0:
                error = PeerUnreachable if code in (errno.ESRCH, errno.EPERM) else WriteFailed
                raise error("process_vm_writev", -code, self.peer, nbytes, detail=_refusal(code, self._owner.pid))
            if got != want:  # a range the owner unmapped since it answered
                raise WriteFailed("process_vm_writev", -1, self.peer, nbytes, detail=f"wrote {got} of {want} bytes")

    def _enter(self, nbytes: int) -> None:
        with self._cond:
            if self._closed:
                raise PeerUnreachable("write", -1, self.peer, nbytes, detail="the link is closed")
            if not self._owner.alive():
                raise PeerUnreachable("write", -1, self.peer, nbytes, detail="the process that owns the memory is gone")
            self._busy += 1

    def _leave(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def probe(self) -> None:
        if not self._owner.alive():
            raise PeerUnreachable("probe", -1, self.peer, detail="the process that owns the memory is gone")

    def close(self) -> None:
        """Refuse later writes and wait for the call in progress: once this returns, nothing
        of ours lands in the owner's memory."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._busy == 0)
            self._owner.close()


class CmaTransport(Transport):
    kind = KIND

    def __init__(self):
        if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
            raise TransportError(f"{KIND} needs Linux 5.3+ (process_vm_writev, pidfd_open)")
        self.writev, self._readv = _calls()
        self.host = host_identity()

    def expose(self, regions: Sequence[tuple[int, int]]) -> CmaExposure:
        return CmaExposure(regions)

    def reach_problem(self, offer: Offer) -> str | None:
        """None if the offer's owner answers and the kernel lets us write it (a byte of its
        first region read back), else why not; a peer elsewhere takes its next offer."""
        try:
            owner = self._owner(offer)
        except TransportError as exc:
            return str(exc)
        try:
            return self._permission(owner)
        finally:
            owner.close()

    def connect(self, offer: Offer, local: Exposure, lane: int = 0) -> CmaLink:
        if not isinstance(local, CmaExposure):
            raise TransportError(f"{KIND} cannot write from a {type(local).__name__}")
        owner = self._owner(offer)
        problem = self._permission(owner)
        if problem:
            owner.close()
            raise TransportError(problem)
        return CmaLink(self, local, owner)

    def _owner(self, offer: Offer) -> _Owner:
        if offer.kind != KIND:
            raise TransportError(f"not {KIND}")
        if offer.host != self.host:
            raise TransportError(f"{KIND}: the peer is on another host ({offer.host} vs {self.host})")
        try:
            name = msgspec.msgpack.decode(offer.blob, type=_Blob).socket
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransportError(f"malformed {KIND} offer: {exc}") from None
        if not name.startswith(_PREFIX) or len(name) > 100:
            raise TransportError(f"malformed {KIND} offer: not one of our sockets")
        try:
            return _Owner(name)
        except OSError as exc:  # another network namespace, gone, silent
            raise TransportError(f"{KIND}: the peer's socket does not answer here ({exc})") from None

    def _permission(self, owner: _Owner) -> str | None:
        if not owner.regions:
            return None
        byte = ctypes.create_string_buffer(1)
        local, remote = (
            _iov(np.array([ctypes.addressof(byte)]), np.array([1])),
            _iov(np.array([owner.regions[0][0]]), np.array([1])),
        )
        if self._readv(owner.pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0) == 1:
            return None
        return f"{KIND}: {_refusal(ctypes.get_errno(), owner.pid)}"


# ---- as the registry sees it (transfer/transports/kind.py) ----


def _create(common: TransportSettings, own) -> CmaTransport:
    return CmaTransport()


# Not part of `auto`: a caller that wants it names it before the transport that reaches other
# hosts (disagg.vllm's CPU workers: cma, then mooncake; the receiver offers both, the writer
# takes the first it reaches).
CMA = TransportKind(KIND, _create, auto=False)
