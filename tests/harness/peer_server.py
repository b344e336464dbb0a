"""A standalone receiver: a pool, a transport, a command socket and a chunk channel.
Benchmarks and tests drive real transfers into it from another process.

    PYTHONPATH=.:tests python -m harness.peer_server --preset gpt-oss-120b --page-size 16 --tokens 65536

Once ready it prints one JSON line with the endpoints it bound ({"command": ..., "chunks": ...,
"channels": [...]}): `--chunk-channels K` binds K chunk channels ("chunks" is the first), one
per sender process (a PAIR socket pairs with one peer; harness.sender_server).
PeerCore is the receiver's state and command handling without sockets (harness.local_peer
runs it in-process behind the fake memory transport).
"""

import argparse
import hashlib
import json
import logging
import sys
import threading

import msgspec
import numpy as np
import torch
import zmq

from disagg.control.outbox import Outbox
from disagg.process import freeze_heap
from harness.pair_channel import PairChannel
from harness.wire import (
    Alloc,
    Allocated,
    Available,
    ChunkDone,
    Command,
    Configure,
    Counts,
    Digest,
    Digests,
    Error,
    Expect,
    Fill,
    Free,
    Fragment,
    Hello,
    Ok,
    Release,
    Reply,
    Stop,
    Verify,
    Target,
)
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from kvpool.indices import IndexSet
from kvpool.positions import backed, kept_positions, paged_components, token_items
from transfer.config import TransferConfig

from transfer.errors import DisaggError, StagingError
from transfer.endpoint import PoolEndpoint
from transfer.receiver import KVReceiver
from transfer.scatters import Scattered, ScatterPool
from transfer.reshard import Shard
from disagg.engine.standin import StandInEngine
from transfer.transports import TRANSPORTS, Transport, TransportSettings, create

log = logging.getLogger("harness.peer_server")


class PeerCore:
    """A receiver's pool and requests, driven by Commands."""

    def __init__(self, transport: Transport, configure: Configure):
        self.transport = transport
        self.pool: HybridPool | None = None
        self.receiver: KVReceiver | None = None
        self.lock = threading.Lock()
        self.configure(configure)

    def configure(self, c: Configure) -> None:
        if self.receiver is not None:
            self.receiver.endpoint.close()  # unregister before the old pool's memory goes away
        self.receiver = self.pool = None
        self.requests: dict[int, object] = {}
        self.expect: dict[int, tuple[IndexSet, list[int], int]] = {}
        self.next_req = 1
        self.lanes_of: dict[Shard, object] = {}  # per sender shard, as decode keeps them (instances.py)
        self.pool = HybridPool(
            PoolConfig(
                get_preset(c.preset),
                c.page_size,
                max_tokens=c.tokens,
                max_requests=c.max_requests,
                layout=Layout(c.layout),
                device=c.device,
                swa_ratio=c.swa_ratio,
                tp_size=c.tp_size,
                tp_rank=c.tp_rank,
            )
        )
        self.receiver = KVReceiver(
            PoolEndpoint(
                self.transport,
                self.pool,
                TransferConfig(staging_slots=c.staging_slots, staging_slot_bytes=c.staging_slot_bytes),
            )
        )

    def _lanes(self, shard: Shard):
        """Our lanes a sender of `shard` names, worked out once per shard: the scatter's cache
        of their bands is keyed by these very lanes (transfer.staging)."""
        if shard not in self.lanes_of:
            self.lanes_of[shard] = self.receiver.lanes_from(shard)
        return self.lanes_of[shard]

    def expecting(self, transfer_id: int) -> bool:
        with self.lock:
            return transfer_id in self.expect

    def on_chunk(self, transfer_id: int, index: int, slot: int, pieces) -> None:
        with self.lock:
            expected = self.expect.get(transfer_id)
        if expected is None:
            raise StagingError(f"chunk for unknown transfer {transfer_id}")
        dst, leased, num_tokens, lanes, prefix_len = expected
        self.receiver.on_chunk(index, slot, pieces, dst, leased, num_tokens, lanes=lanes, prefix_len=prefix_len)

    def handle(self, cmd: Command) -> Reply:
        match cmd:
            case Configure() as c:
                with self.lock:
                    self.configure(c)
                return Ok()
            case Hello():
                r = self.receiver.endpoint
                pc = self.pool.config
                return Target(r.offers(), r.buffers, r.staging_info(), pc.page_size, pc.tp_size, pc.tp_rank)
            case Alloc(num_tokens=n, window_only=w):
                req = self.pool.alloc_request(n, swa_window_only=w)
                rid, self.next_req = self.next_req, self.next_req + 1
                self.requests[rid] = req
                iset = self.pool.index_set(req)
                return Allocated(rid, {c.value: iset[c].tobytes() for c in iset.components()})
            case Fragment(seed=seed):
                rng = np.random.default_rng(seed)
                for alloc in (self.pool.pages, getattr(self.pool.swa_allocator, "swa", None)):
                    if alloc is not None:
                        rng.shuffle(alloc._stack[: alloc.num_free])
                return Ok()
            case Expect(transfer_id=t, req=rid, want_slots=k, sender=sender, prefix_len=prefix_len):
                lanes = None if sender is None else self._lanes(Shard(*sender))
                slots = self.receiver.reserve_slots(k) if k else []
                with self.lock:
                    self.expect[t] = (
                        self.pool.index_set(self.requests[rid]),
                        slots,
                        self.requests[rid].num_tokens,
                        lanes,
                        prefix_len,
                    )
                return Allocated(t, {"slots": np.array(slots, dtype=np.int32).tobytes()})
            case Release(transfer_id=t):
                with self.lock:
                    _, slots, *_ = self.expect.pop(t)
                self.receiver.release_slots(slots)
                return Ok()
            case Digest(req=rid, outside=outside, by_token=by_token, below=below):
                req = self.requests[rid]
                if below:
                    return Digests(digest_tokens(self.pool, req, below), None)
                digest = digest_tokens if by_token else digest_request
                return Digests(digest(self.pool, req), digest_outside(self.pool, req) if outside else None)
            case Fill(req=rid, tokens=tokens, room=room, upto=upto, garbage=garbage):
                req, positions = self.requests[rid], np.arange(upto)
                if garbage:
                    fill_garbage(self.pool, req, positions, room)
                else:
                    StandInEngine()._write_tokens(
                        self.pool, req, np.frombuffer(tokens, dtype=np.int64).copy(), positions
                    )
                return Ok()
            case Free(req=rid):
                self.pool.free_request(self.requests.pop(rid))
                return Ok()
            case Verify(req=rid, tokens=tokens, room=room):
                StandInEngine().verify(
                    self.pool, self.requests[rid], np.frombuffer(tokens, dtype=np.int64).copy(), room
                )
                return Ok()
            case Available():
                self.pool.check_integrity()
                return Counts(self.pool.available(), self.receiver.endpoint.staging.lease.available())
        return Error(f"unknown command {type(cmd).__name__}")

    def call(self, cmd: Command) -> Reply:
        try:
            return self.handle(cmd)
        except (DisaggError, KeyError, ValueError) as exc:
            return Error(f"{type(exc).__name__}: {exc}")


class PeerServer:
    def __init__(self, args: argparse.Namespace):
        own = TRANSPORTS.own_settings(args)  # (--mooncake-engines, ...)
        [transport] = create([args.transport], TransportSettings(args.host, args.device, own))
        self.core = PeerCore(
            transport,
            Configure(
                args.preset,
                args.page_size,
                args.tokens,
                args.layout,
                args.max_requests,
                args.swa_ratio,
                args.device,
                args.staging_slots,
                args.staging_slot_mib << 20,
            ),
        )
        ctx = zmq.Context.instance()
        self.commands = ctx.socket(zmq.REP)
        self.commands.bind(args.command)
        self.channels = [PairChannel(ctx.socket(zmq.PAIR)) for _ in range(max(1, args.chunk_channels))]
        for ch in self.channels:
            ch.socket.bind(args.chunks)
        self.stopping = threading.Event()
        self.scatter_workers = args.scatter_workers
        # Ready: tell the parent where we listen (binding "tcp://host:*" picks free ports).
        bound = [ch.socket.getsockopt_string(zmq.LAST_ENDPOINT) for ch in self.channels]
        print(
            json.dumps(
                {"command": self.commands.getsockopt_string(zmq.LAST_ENDPOINT), "chunks": bound[0], "channels": bound}
            ),
            flush=True,
        )

    def serve_chunks(self) -> None:
        """Every channel's notices, scattered on the scatter workers (as decode does,
        disagg/decode/chunks.py): N senders' chunks side by side; each ack once its chunk and
        every earlier one of its transfer are scattered."""
        wakes = Outbox(zmq.Context.instance())
        scatters = ScatterPool(self.scatter_workers, lambda: wakes.put(b""), name="peer-scatter")
        poller = zmq.Poller()
        for ch in self.channels:
            poller.register(ch.socket, zmq.POLLIN)
        poller.register(wakes.pull, zmq.POLLIN)
        by_socket = {ch.socket: ch for ch in self.channels}
        try:
            while not self.stopping.is_set():
                for sock, _ in poller.poll(100):
                    if sock is wakes.pull:
                        while wakes.pull.poll(0):
                            wakes.pull.recv()
                    else:
                        self._serve(by_socket[sock], scatters)
                self._acks(scatters)
        finally:
            scatters.close()
            wakes.close()

    def _serve(self, channel: PairChannel, scatters: ScatterPool) -> None:
        try:
            n = channel.recv_notice(0.1)
        except StagingError as exc:  # untrusted input: refuse, keep serving
            log.warning("chunk refused: %s", exc)
            return
        scatters.submit(
            (channel, n.transfer_id),
            n.index,
            lambda: self.core.expecting(n.transfer_id),
            lambda: self.core.on_chunk(n.transfer_id, n.index, n.slot, n.pieces),
            tag=channel,
        )

    @staticmethod
    def _acks(scatters: ScatterPool) -> None:
        for o in scatters.drain():
            if o.state is Scattered.FAILED:
                log.warning("chunk %d refused: %s", o.index, o.error)
            elif o.ack_upto is not None:
                o.tag.send_done(ChunkDone(o.stream[1], o.ack_upto))

    def run(self) -> None:
        chunk_thread = threading.Thread(target=self.serve_chunks, daemon=True)
        chunk_thread.start()
        decoder = msgspec.msgpack.Decoder(Command)
        encoder = msgspec.msgpack.Encoder()
        while not self.stopping.is_set():
            raw = self.commands.recv()
            try:
                cmd = decoder.decode(raw)
            except msgspec.DecodeError as exc:
                self.commands.send(encoder.encode(Error(f"DecodeError: {exc}")))
                continue
            if isinstance(cmd, Stop):
                self.stopping.set()
                reply = Ok()
            else:
                reply = self.core.call(cmd)
            self.commands.send(encoder.encode(reply))
        chunk_thread.join()


def digest_request(pool: HybridPool, req) -> dict[str, str]:
    """sha256 per component of the items a transfer of `req` moves, in index order."""
    iset = pool.index_set(req)
    out = {}
    for c in iset.components():
        h = hashlib.sha256()
        for t in pool.pools[c].storage.gather(iset[c]):
            h.update(t.cpu().numpy().tobytes())
        out[c.value] = h.hexdigest()
    return out


def digest_tokens(pool: HybridPool, req, below: int = 0) -> dict[str, str]:
    """sha256 per component of what a transfer of `req` moves, paged components per token
    position (the positions a receiver holds: kvpool.positions.kept_positions) and segment, so
    that pools of different page sizes compare; state slots and the AUX row as items.
    `below` > 0: paged components only, the positions [0, below) the request holds (a prefix)."""
    out = {} if below else digest_request(pool, req)
    for c in paged_components(pool):
        positions = kept_positions(pool, c, req.num_tokens)
        if below:
            items, _ = token_items(pool, c, req, positions)
            positions = positions[(positions < below) & backed(items)]
        items, slots = token_items(pool, c, req, positions)
        at = torch.from_numpy(items.astype(np.int64)), torch.from_numpy(slots.astype(np.int64))
        h = hashlib.sha256()
        for pl in pool.pools[c].storage.packed.placements:
            view = pool.layer_view(pl.segment.layer, pl.segment.part)
            h.update(
                view[at[0].to(view.device), at[1].to(view.device)]
                .cpu()
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .tobytes()
            )
        out[c.value] = h.hexdigest()
    return out


def fill_garbage(pool: HybridPool, req, positions: np.ndarray, seed: int) -> None:
    """Random bytes (seeded) into every paged component's rows of `positions` the request holds."""
    gen = torch.Generator().manual_seed(seed)
    for c in paged_components(pool):
        items, slots = token_items(pool, c, req, positions)
        keep = backed(items)
        at = torch.from_numpy(items[keep].astype(np.int64)), torch.from_numpy(slots[keep].astype(np.int64))
        for pl in pool.pools[c].storage.packed.placements:
            raw, per_token = StandInEngine._token_bytes(pool.layer_view(pl.segment.layer, pl.segment.part))
            rows = torch.randint(0, 256, (len(at[0]), per_token), dtype=torch.uint8, generator=gen)
            raw[at[0].to(raw.device), at[1].to(raw.device)] = rows.to(raw.device)


def digest_outside(pool: HybridPool, req) -> str:
    """sha256 over every pool item `req` does not hold: proves nothing else was written."""
    h = hashlib.sha256()
    iset = pool.index_set(req)
    for c, p in pool.pools.items():
        mask = torch.ones(p.storage.num_items, dtype=torch.bool, device=p.storage.device)
        mask[torch.from_numpy(iset[c].astype(np.int64)).to(p.storage.device)] = False
        for buf in p.storage.buffers:
            h.update(buf[mask].cpu().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, required=True, help="pool capacity in tokens")
    ap.add_argument("--max-requests", type=int, default=8)
    ap.add_argument("--swa-ratio", type=float, default=0.5)
    ap.add_argument("--layout", default="page_major", choices=[l.value for l in Layout])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--staging-slots", type=int, default=4)
    ap.add_argument("--staging-slot-mib", type=int, default=16)
    ap.add_argument("--command", default="tcp://127.0.0.1:*", help="command socket (REP) to bind")
    ap.add_argument("--chunks", default="tcp://127.0.0.1:*", help="chunk channel (PAIR) to bind")
    ap.add_argument("--chunk-channels", type=int, default=1, help="chunk channels to bind: one per sender process")
    ap.add_argument(
        "--scatter-workers", type=int, default=4, help="threads scattering chunks (decode's --scatter-workers)"
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: gather/scatter copies leave the transport's threads a core)",
    )
    TRANSPORTS.add_flags(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    server = PeerServer(args)
    freeze_heap()  # (as the workers do: disagg.process.freeze_heap)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
