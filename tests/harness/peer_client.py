"""Drive a receiver: PeerProcess (harness.peer_server in a child process, a real transport
between the two) and LocalPeer (the same receiver in this process, behind any transport, e.g.
the fake memory transport). Both have the same methods, so a test runs against either."""

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import numpy as np
import zmq

from harness.pair_channel import PairChannel
from harness.processes import reap, spawn
from harness.peer_server import PeerCore
from harness.wire import (
    Alloc,
    Allocated,
    Available,
    Configure,
    Counts,
    Digest,
    Digests,
    Error,
    Expect,
    Fill,
    Fragment,
    Free,
    Hello,
    Release,
    Reply,
    Stop,
    Target,
    Verify,
)
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.errors import AckTimeout, StagingError, TransferError
from transfer.sender import KVSender, RemotePool
from transfer.transports import Transport

TESTS = Path(__file__).resolve().parent.parent
# The repo root first: tests/kvpool (a folder of tests) must not shadow the kvpool package.
HARNESS_PATH = [str(TESTS.parent), str(TESTS)]


class _Driver:
    """The typed commands, over whatever call() does."""

    def call(self, cmd, timeout: float = 60.0) -> Reply:
        raise NotImplementedError

    def _ok(self, cmd, timeout: float = 60.0) -> Reply:
        reply = self.call(cmd, timeout)
        if isinstance(reply, Error):
            raise TransferError(f"peer server: {reply.message}")
        return reply

    def configure(
        self,
        preset: str,
        page_size: int,
        tokens: int,
        layout: str = "page_major",
        max_requests: int = 8,
        swa_ratio: float = 0.5,
        device: str = "cpu",
        staging_slots: int = 4,
        staging_slot_mib: int = 16,
        tp: tuple[int, int] = (1, 0),
    ) -> Target:
        """Rebuild the server's pool (every old request is dropped); returns the new target."""
        self._ok(
            Configure(
                preset,
                page_size,
                tokens,
                layout,
                max_requests,
                swa_ratio,
                device,
                staging_slots,
                staging_slot_mib << 20,
                *tp,
            )
        )
        return self.target()

    def target(self) -> Target:
        return self._ok(Hello())

    def connect(self, sender: KVSender) -> RemotePool:
        t = self.target()
        return sender.connect(t.offers, t.buffers, t.staging, t.page_size, (t.tp_size, t.tp_rank))

    def alloc(self, num_tokens: int, window_only: bool = True) -> tuple[int, IndexSet]:
        reply = self._ok(Alloc(num_tokens, window_only))
        return reply.id, IndexSet({Component(k): np.frombuffer(v, dtype=np.int32) for k, v in reply.arrays.items()})

    def fragment(self, seed: int) -> None:
        self._ok(Fragment(seed))

    def expect(
        self,
        transfer_id: int,
        req: int,
        want_slots: int = 0,
        sender: tuple[int, int, int] | None = None,
        prefix_len: int = 0,
    ) -> list[int]:
        reply: Allocated = self._ok(Expect(transfer_id, req, want_slots, sender, prefix_len))
        return np.frombuffer(reply.arrays["slots"], dtype=np.int32).tolist()

    def release(self, transfer_id: int) -> None:
        self._ok(Release(transfer_id))

    def digest(self, req: int, outside: bool = False, by_token: bool = False, below: int = 0) -> Digests:
        return self._ok(Digest(req, outside, by_token, below))

    def fill(self, req: int, tokens: np.ndarray, room: int, upto: int, garbage: bool = False) -> None:
        """Positions [0, upto) of the request as a decode that cached that prefix holds them
        (the stand-in's bytes), or random bytes (`garbage`, seeded by room)."""
        self._ok(Fill(req, np.asarray(tokens, dtype=np.int64).tobytes(), room, upto, garbage))

    def verify(self, req: int, tokens: np.ndarray, room: int) -> None:
        """The stand-in engine's check of the request's KV (TransferError naming what differs)."""
        self._ok(Verify(req, np.asarray(tokens, dtype=np.int64).tobytes(), room))

    def free(self, req: int) -> None:
        self._ok(Free(req))

    def available(self) -> Counts:
        return self._ok(Available())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PeerProcess(_Driver):
    def __init__(
        self,
        preset: str,
        page_size: int,
        tokens: int,
        layout: str = "page_major",
        device: str = "cpu",
        staging_slots: int = 4,
        staging_slot_mib: int = 16,
        max_requests: int = 8,
        swa_ratio: float = 0.5,
        env: dict | None = None,
        start_timeout: float = 60.0,
        transport: str = "mooncake",
        chunk_channels: int = 1,
        scatter_workers: int = 4,
        wait: bool = True,
        flags: tuple[str, ...] = (),
    ):
        """`chunk_channels`: chunk channels the server binds; `.channel` is the first (this
        process's senders share it), `.channels` names them all (a sender process connects
        its own, harness.sender_client); `scatter_workers`: threads scattering its chunks;
        `wait`: wait here for the server to start (else `ready()` does; see start_many);
        `flags`: the transports' own flags (--mooncake-engines, ...)."""
        cmd = [
            sys.executable,
            "-m",
            "harness.peer_server",
            "--preset",
            preset,
            "--page-size",
            str(page_size),
            "--tokens",
            str(tokens),
            "--layout",
            layout,
            "--device",
            device,
            "--transport",
            transport,
            "--staging-slots",
            str(staging_slots),
            "--staging-slot-mib",
            str(staging_slot_mib),
            "--max-requests",
            str(max_requests),
            "--swa-ratio",
            str(swa_ratio),
            "--chunk-channels",
            str(chunk_channels),
            "--scatter-workers",
            str(scatter_workers),
            *flags,
        ]
        env = dict(env if env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*HARNESS_PATH, env.get("PYTHONPATH")]))
        self.proc = spawn(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.sock = None
        if wait:
            self.ready(start_timeout)

    @classmethod
    def start_many(cls, count: int, start_timeout: float = 60.0, **kw) -> list["PeerProcess"]:
        """`count` peer servers started at once (each started process imports torch and builds its
        pool beside the others), then each waited for: the start costs one process's, not count's."""
        peers = [cls(**kw, wait=False) for _ in range(count)]
        try:
            return [p.ready(start_timeout) for p in peers]
        except BaseException:
            for p in peers:
                p.close()
            raise

    def ready(self, start_timeout: float = 60.0) -> "PeerProcess":
        """Wait for the server's endpoints line, then connect its command and chunk sockets."""
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                raise TransferError(f"peer server did not start (exit code {self.proc.poll()})")
            endpoints = json.loads(line)
        except BaseException:
            reap(self.proc, signal.SIGKILL)
            raise
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.REQ)
        self.sock.connect(endpoints["command"])
        self.channel = PairChannel(ctx.socket(zmq.PAIR))
        self.channel.socket.connect(endpoints["chunks"])
        self.channels: list[str] = endpoints["channels"]
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)
        return self

    def call(self, cmd, timeout: float = 60.0) -> Reply:
        self.sock.send(self._enc.encode(cmd))
        if not self.sock.poll(int(timeout * 1000)):
            raise TransferError(f"peer server did not answer {type(cmd).__name__} within {timeout} s")
        return self._dec.decode(self.sock.recv())

    def close(self) -> None:
        if self.sock is None:  # never started (or its start failed: ready() reaped it)
            reap(self.proc, signal.SIGKILL, 0)
            return
        if self.proc.poll() is None:
            try:
                self.call(Stop(), timeout=10)
                self.proc.wait(timeout=10)
            except (TransferError, subprocess.TimeoutExpired):
                pass
        reap(self.proc, signal.SIGKILL, 0)  # (whatever it left: nothing, unless it hung)
        self.sock.close(linger=0)
        self.channel.socket.close(linger=0)


class LocalChannel:
    """A ChunkChannel that scatters on notify (in the sender's thread), acks at once; a chunk
    the receiver refuses is never acked, as with the real channel."""

    def __init__(self, core: PeerCore):
        self._core = core
        self._done: dict[int, int] = {}
        self._cond = threading.Condition()

    def notify(self, transfer_id: int, index: int, slot: int, pieces) -> None:
        try:
            self._core.on_chunk(transfer_id, index, slot, pieces)
        except StagingError as exc:  # refused, as the real receiver does: no ack, and say why
            logging.getLogger("harness.local_peer").warning("chunk refused: %s", exc)
            return
        with self._cond:
            self._done[transfer_id] = max(index, self._done.get(transfer_id, -1))
            self._cond.notify_all()

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done.get(transfer_id, -1) >= index, timeout):
                raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s")

    def end(self, transfer_id: int) -> None:
        with self._cond:
            self._done.pop(transfer_id, None)


class LocalPeer(_Driver):
    def __init__(self, transport: Transport, preset: str, page_size: int, tokens: int, **kw):
        self.core = PeerCore(transport, Configure(preset, page_size, tokens, **kw))
        self.channel = LocalChannel(self.core)

    def call(self, cmd, timeout: float = 60.0) -> Reply:
        return self.core.call(cmd)

    def close(self) -> None:
        self.core.receiver.endpoint.close()
