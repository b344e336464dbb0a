"""A standalone sender: one prefill rank's pool (the stand-in engine's KV of one request), a
transport and a command socket; it sends that request into receivers (harness.peer_server)
when told, every receiver at once, as a prefill worker of a TP instance does: a process per
rank, so N ranks' senders never share one GIL (scripts/bench_tp.py --senders process).

    PYTHONPATH=.:tests python -m harness.sender_server --preset gpt-oss-120b --tp 8 --rank 3 \\
        --num-tokens 4096

Once ready it prints one JSON line with the command endpoint it bound ({"command": ...}).
Each receiver it links to gets a chunk channel of its own (Link.chunks: one of the receiver's
channels no other sender uses).
"""

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import torch
import zmq

from disagg.engine.standin import StandInEngine
from disagg.process import freeze_heap
from harness.pair_channel import PairChannel
from harness.wire import Error, Link, Ok, Prepare, Send, SenderCommand, SendTo, Sent, Stop
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.config import Mode, TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.errors import DisaggError
from transfer.fanout import FanOut, FanOutSend, PreparedFan
from transfer.sender import KVSender, PreparedSend, RemotePool
from transfer.staging import RemoteSlots
from transfer.transports import TRANSPORTS, TransportSettings, create


class SenderCore:
    """The rank's pool with its one request, its sender, and its links by key."""

    def __init__(self, args: argparse.Namespace):
        own = TRANSPORTS.own_settings(args)  # (--cuda-ipc-blocks, ...)
        [self.transport] = create([args.transport], TransportSettings("127.0.0.1", args.device, own))
        model = get_preset(args.preset)
        self.pool = HybridPool(
            PoolConfig(
                model,
                args.page_size,
                max_tokens=int(args.num_tokens * 2.5),
                max_requests=2,
                layout=Layout(args.layout),
                tp_size=args.tp,
                tp_rank=args.rank,
                device=args.device,
            )
        )
        self.req = self.pool.alloc_request(args.num_tokens)
        ids = np.random.default_rng(args.seed).integers(0, 50000, args.num_tokens)
        StandInEngine().prefill(self.pool, self.req, ids, args.room)
        self.num_tokens = args.num_tokens
        config = TransferConfig(
            mode=Mode(args.mode), staging_slots=args.staging_slots, staging_chunk_bytes=args.staging_chunk_kib << 10
        )
        self.endpoint = PoolEndpoint(self.transport, self.pool, config)
        self.sender = KVSender(self.endpoint)
        self.links: dict[int, tuple[RemotePool, PairChannel]] = {}
        self.prepared: dict[int, PreparedSend] = {}  # by link key: laid out by Prepare, for the next Send
        self.prepared_fan: PreparedFan | None = None
        self.ctx = zmq.Context.instance()
        # the sends of one command run at once on threads kept for the process's life, as a
        # prefill worker's per-peer shards are
        self.workers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="send")

    def link(self, cmd: Link) -> None:
        t = cmd.target
        peer = self.sender.connect(t.offers, t.buffers, t.staging, t.page_size, (t.tp_size, t.tp_rank))
        channel = PairChannel(self.ctx.socket(zmq.PAIR))
        channel.socket.connect(cmd.chunks)
        self.links[cmd.key] = (peer, channel)

    def _fan(self, cmd: Send | Prepare) -> list[FanOutSend]:
        return [
            FanOutSend(self.links[s.key][0], self._dst(s), RemoteSlots(s.transfer_id, s.slots, self.links[s.key][1]))
            for s in cmd.sends
            if s.key in self.links
        ]

    def prepare(self, cmd: Prepare) -> None:
        """The sends of the next Send laid out now, as a prefill worker does while the KV computes
        (disagg/prefill/jobs.py): as one fan-out where the links allow, else each on its own."""
        fan, src = self._fan(cmd), self.pool.index_set(self.req)
        if len(fan) == len(cmd.sends) and FanOut.fits(fan):
            self.prepared_fan = FanOut(self.sender).prepare(src, fan, self.num_tokens)
            return
        for f, s in zip(fan, cmd.sends):
            stage = KVSender.can_stage(f.peer, f.remote)
            self.prepared[s.key] = self.sender.prepare(f.peer, src, f.dst, self.num_tokens, False, stage)

    def send(self, cmd: Send) -> Sent:
        """Every SendTo at once: as one fan-out where the links allow (transfer.fanout: one
        plan, one write), else a thread each; the first failure is raised once all ended. A
        send laid out by Prepare starts from it where it fits (else it is planned here)."""
        fan = self._fan(cmd)
        if len(fan) == len(cmd.sends) and FanOut.fits(fan):
            prepared, self.prepared_fan = self.prepared_fan, None
            src = self.pool.index_set(self.req)
            results = FanOut(self.sender).send(src, fan, num_tokens=self.num_tokens, prepared=prepared)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            return Sent(results)
        return self._threads(cmd)

    @staticmethod
    def _dst(s: SendTo) -> IndexSet:
        return IndexSet({Component(k): np.frombuffer(v, dtype=np.int32) for k, v in s.arrays.items()})

    def _threads(self, cmd: Send) -> Sent:
        def one(s: SendTo):
            peer, channel = self.links[s.key]
            return self.sender.send(
                peer,
                self.pool.index_set(self.req),
                self._dst(s),
                RemoteSlots(s.transfer_id, s.slots, channel),
                num_tokens=self.num_tokens,
                prepared=self.prepared.pop(s.key, None),
            )

        jobs = [self.workers.submit(one, s) for s in cmd.sends]
        errors = [j.exception() for j in jobs]  # (every send ended before any is raised)
        for exc in errors:
            if exc is not None:
                raise exc
        return Sent([j.result() for j in jobs])

    def close(self) -> None:
        for peer, channel in self.links.values():
            peer.link.close()
            channel.socket.close(linger=0)
        self.workers.shutdown()
        self.endpoint.close()


def serve(core: SenderCore, sock: zmq.Socket) -> None:
    """Commands until Stop: each answered Ok, Sent, or Error naming what failed."""
    decoder, encoder = msgspec.msgpack.Decoder(SenderCommand), msgspec.msgpack.Encoder()
    while True:
        try:
            cmd = decoder.decode(sock.recv())
        except msgspec.DecodeError as exc:
            sock.send(encoder.encode(Error(f"DecodeError: {exc}")))
            continue
        if isinstance(cmd, Stop):
            sock.send(encoder.encode(Ok()))
            return
        try:
            match cmd:
                case Send():
                    reply = core.send(cmd)
                case Prepare():
                    reply = (core.prepare(cmd), Ok())[1]
                case _:
                    reply = (core.link(cmd), Ok())[1]
        except (DisaggError, KeyError, ValueError) as exc:
            reply = Error(f"{type(exc).__name__}: {exc}")
        sock.send(encoder.encode(reply))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="page_major", choices=[l.value for l in Layout])
    ap.add_argument("--tp", type=int, default=1, help="the prefill instance's TP size")
    ap.add_argument("--rank", type=int, default=0, help="this process's TP rank")
    ap.add_argument("--num-tokens", type=int, required=True, help="the request's length")
    ap.add_argument("--seed", type=int, default=0, help="the request's token ids (a seeded draw)")
    ap.add_argument("--room", type=int, default=11, help="the stand-in engine's room")
    ap.add_argument("--mode", default="auto", choices=[m.value for m in Mode])
    ap.add_argument("--staging-slots", type=int, default=4)
    ap.add_argument("--staging-chunk-kib", type=int, default=0, help="a staged chunk's size (0: a whole slot)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--command", default="tcp://127.0.0.1:*", help="command socket (REP) to bind")
    TRANSPORTS.add_flags(ap)  # each transport's own (--cuda-ipc-blocks, ...)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (a prefill worker's default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    core = SenderCore(args)
    freeze_heap()  # (as the workers do: disagg.process.freeze_heap)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(args.command)
    print(json.dumps({"command": sock.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    try:
        serve(core, sock)
    finally:
        core.close()
        sock.close(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
