"""Drive a sender process (harness.sender_server): one prefill rank with its own pool, GIL and
transport, as a prefill worker of a TP instance runs. A send is started on every sender
process before any is waited for, so all ranks send at once."""

import json
import os
import select
import signal
import subprocess
import sys

import msgspec
import zmq

from harness.peer_client import HARNESS_PATH
from harness.processes import reap, spawn
from harness.wire import Error, Link, Prepare, Send, SenderReply, SendTo, Sent, Stop, Target
from transfer.errors import TransferError


class SenderProcess:
    def __init__(
        self,
        preset: str,
        page_size: int,
        num_tokens: int,
        tp: tuple[int, int],
        *,
        layout: str = "page_major",
        seed: int = 0,
        room: int = 11,
        mode: str = "auto",
        staging_slots: int = 4,
        device: str = "cpu",
        transport: str = "mooncake",
        env: dict | None = None,
        flags: tuple[str, ...] = (),
    ):
        cmd = [
            sys.executable,
            "-m",
            "harness.sender_server",
            "--preset",
            preset,
            "--page-size",
            str(page_size),
            "--layout",
            layout,
            "--tp",
            str(tp[0]),
            "--rank",
            str(tp[1]),
            "--num-tokens",
            str(num_tokens),
            "--seed",
            str(seed),
            "--room",
            str(room),
            "--mode",
            mode,
            "--staging-slots",
            str(staging_slots),
            "--device",
            device,
            "--transport",
            transport,
            *flags,  # transports' own (--cuda-ipc-blocks N, ...)
        ]
        env = dict(env if env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*HARNESS_PATH, env.get("PYTHONPATH")]))
        self.proc = spawn(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.sock = None
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(SenderReply)

    def ready(self, timeout: float = 120.0) -> "SenderProcess":
        """Wait for the ready line (the pool built and prefilled), then connect its command socket."""
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                raise TransferError(f"sender process did not start (exit code {self.proc.poll()})")
        except BaseException:
            self.close()
            raise
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.connect(json.loads(line)["command"])
        return self

    def _reply(self, timeout: float):
        if not self.sock.poll(int(timeout * 1000)):
            raise TransferError(f"sender process did not answer within {timeout} s")
        reply = self._dec.decode(self.sock.recv())
        if isinstance(reply, Error):
            raise TransferError(f"sender process: {reply.message}")
        return reply

    def link(self, key: int, target: Target, chunks: str) -> None:
        """Connect to a receiver, over its chunk channel `chunks` (one no other sender uses)."""
        self.sock.send(self._enc.encode(Link(key, target, chunks)))
        self._reply(60.0)

    def prepare(self, sends: list[SendTo]) -> None:
        """Lay the sends out ahead (Prepare): the next start_send of the same sends uses it."""
        self.sock.send(self._enc.encode(Prepare(sends)))
        self._reply(120.0)

    def start_send(self, sends: list[SendTo]) -> None:
        """Start the sends (all at once there); finish_send() waits for their reports."""
        self.sock.send(self._enc.encode(Send(sends)))

    def finish_send(self, timeout: float = 120.0) -> Sent:
        return self._reply(timeout)

    def close(self) -> None:
        if self.sock is not None and self.proc.poll() is None:
            try:
                self.sock.send(self._enc.encode(Stop()))
                self._reply(10.0)
                self.proc.wait(timeout=10)
            except (TransferError, zmq.ZMQError, subprocess.TimeoutExpired):
                pass
        reap(self.proc, signal.SIGKILL, 0)
        if self.sock is not None:
            self.sock.close(linger=0)
