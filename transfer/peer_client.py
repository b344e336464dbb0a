"""PeerProcess: start a transfer.peer_server in a child process and drive it."""

import json
import select
import subprocess
import sys

import msgspec
import numpy as np
import zmq

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.errors import TransferError
from transfer.pair_channel import PairChannel
from transfer.peer import PeerTarget
from transfer.wire import (Alloc, Allocated, Available, Configure, Counts, Digest, Digests, Error, Expect, Fragment, Free,
                           Hello, Release, Reply, Stop, Target, target_from_wire)


class PeerProcess:
    def __init__(self, preset: str, page_size: int, tokens: int, layout: str = "page_major",
                 device: str = "cpu", staging_slots: int = 4, staging_slot_mib: int = 16,
                 max_requests: int = 8, swa_ratio: float = 0.5, env: dict | None = None,
                 start_timeout: float = 60.0):
        cmd = [sys.executable, "-m", "transfer.peer_server", "--preset", preset, "--page-size", str(page_size),
               "--tokens", str(tokens), "--layout", layout, "--device", device,
               "--staging-slots", str(staging_slots), "--staging-slot-mib", str(staging_slot_mib),
               "--max-requests", str(max_requests), "--swa-ratio", str(swa_ratio)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise TransferError(f"peer server did not start (exit code {self.proc.poll()})")
        endpoints = json.loads(line)
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.REQ)
        self.sock.connect(endpoints["command"])
        self.channel = PairChannel(ctx.socket(zmq.PAIR))
        self.channel.socket.connect(endpoints["chunks"])
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)

    def call(self, cmd, timeout: float = 60.0) -> Reply:
        self.sock.send(self._enc.encode(cmd))
        if not self.sock.poll(int(timeout * 1000)):
            raise TransferError(f"peer server did not answer {type(cmd).__name__} within {timeout} s")
        reply = self._dec.decode(self.sock.recv())
        if isinstance(reply, Error):
            raise TransferError(f"peer server: {reply.message}")
        return reply

    def configure(self, preset: str, page_size: int, tokens: int, layout: str = "page_major",
                  max_requests: int = 8, swa_ratio: float = 0.5, device: str = "cpu",
                  staging_slots: int = 4, staging_slot_mib: int = 16) -> PeerTarget:
        """Rebuild the server's pool (every old request is dropped); returns the new target."""
        self.call(Configure(preset, page_size, tokens, layout, max_requests, swa_ratio, device,
                            staging_slots, staging_slot_mib << 20))
        return self.target()

    def target(self) -> PeerTarget:
        reply = self.call(Hello())
        assert isinstance(reply, Target)
        return target_from_wire(reply)

    def alloc(self, num_tokens: int, window_only: bool = True) -> tuple[int, IndexSet]:
        reply = self.call(Alloc(num_tokens, window_only))
        assert isinstance(reply, Allocated)
        return reply.id, IndexSet({Component(k): np.frombuffer(v, dtype=np.int32) for k, v in reply.arrays.items()})

    def fragment(self, seed: int) -> None:
        self.call(Fragment(seed))

    def expect(self, transfer_id: int, req: int, want_slots: int = 0) -> list[int]:
        reply = self.call(Expect(transfer_id, req, want_slots))
        return np.frombuffer(reply.arrays["slots"], dtype=np.int32).tolist()

    def release(self, transfer_id: int) -> None:
        self.call(Release(transfer_id))

    def digest(self, req: int, outside: bool = False) -> Digests:
        return self.call(Digest(req, outside))

    def free(self, req: int) -> None:
        self.call(Free(req))

    def available(self) -> Counts:
        return self.call(Available())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(Stop(), timeout=10)
                self.proc.wait(timeout=10)
            except (TransferError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.sock.close(linger=0)
        self.channel.socket.close(linger=0)
        self.proc.stdout.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
