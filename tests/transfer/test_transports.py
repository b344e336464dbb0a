"""The transport registry, the per-peer choice of transport, and a transfer's set of pending
writes (no bytes move here)."""

import argparse
import ctypes

import msgspec
import numpy as np
import pytest

from harness import memory
from kvpool import HybridPool, PoolConfig, get_preset
from transfer.buffers import Buffer
from transfer.config import TransferConfig
from transfer.errors import LayoutIncompatible, TransportError, WriteFailed, WritesAbandoned
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.transports import TRANSPORTS, Offer, PendingWrite, Ranges, TransportSettings, create, pick, resolve
from transfer.transports.cuda_ipc import CudaIpcSettings
from transfer.transports.mooncake import MooncakeSettings
from transfer.transports.base import PendingWrites


def test_auto_and_names_resolve_and_unknown_names_are_refused():
    assert resolve("auto", TransportSettings(device="cpu")) == ("mooncake",)  # CPU pools
    assert resolve("auto", TransportSettings(device="cuda:1")) == ("cuda-ipc", "mooncake")  # GPU first
    assert resolve("auto", TransportSettings(device="cuda")) == ("cuda-ipc", "mooncake")
    assert "memory" not in resolve("auto")  # a test transport never joins auto
    assert resolve("mooncake") == ("mooncake",) and resolve("cuda-ipc") == ("cuda-ipc",)
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; known: auto, cuda-ipc, mooncake"):
        resolve("carrier-pigeon")
    with pytest.raises(ValueError, match="tcp or rdma"):
        MooncakeSettings(protocol="udp")
    with pytest.raises(ValueError, match="one settings record per transport"):
        TransportSettings(own=(MooncakeSettings(), MooncakeSettings("rdma")))


def test_a_registered_kind_is_created_by_name_with_its_own_settings():
    """The test harness's memory transport, registered like Mooncake and CUDA IPC (one line,
    harness/memory.py): create() starts it by name, with its own record or its defaults, and
    it moves bytes between two exposures of this process."""
    memory.register()
    src, dst = bytearray(b"abcdefgh" * 4), bytearray(32)
    regions = [(_address(src), len(src))], [(_address(dst), len(dst))]
    [plain] = create(["memory"], TransportSettings())
    [failing] = create(["memory"], TransportSettings(own=(memory.MemorySettings(fail_writes=True),)))
    assert isinstance(plain, memory.MemoryTransport) and not plain.fail_writes and failing.fail_writes
    ours, theirs = plain.expose(regions[0]), plain.expose(regions[1])
    ranges = Ranges.one(0, 8, 0, 4, 16)
    plain.connect(theirs.offer(), ours).write_async(ranges).wait()
    assert bytes(dst[4:20]) == bytes(src[8:24]) and not any(dst[:4]) and not any(dst[20:])
    with pytest.raises(WriteFailed, match="injected by the memory transport"):
        failing.connect(theirs.offer(), failing.expose(regions[0])).write_async(ranges)


def test_a_kinds_flags_land_on_a_parser_and_its_settings_come_back_from_the_parsed_args():
    memory.register()
    parser = argparse.ArgumentParser()
    TRANSPORTS.add_flags(parser)
    for kind in ("--memory-fail-writes", "--mooncake-protocol", "--rdma-devices", "--cuda-ipc-blocks"):
        assert kind in parser._option_string_actions, kind
    own = TransportSettings(
        own=TRANSPORTS.own_settings(
            parser.parse_args(
                [
                    "--memory-fail-writes",
                    "--mooncake-protocol",
                    "rdma",
                    "--rdma-devices",
                    "mlx5_0",
                    "--cuda-ipc-blocks",
                    "8",
                ]
            )
        )
    )
    assert own.of(memory.MemorySettings) == memory.MemorySettings(fail_writes=True)
    assert own.of(MooncakeSettings) == MooncakeSettings("rdma", "mlx5_0")
    assert own.of(CudaIpcSettings) == CudaIpcSettings(blocks=8)
    defaults = TransportSettings(own=TRANSPORTS.own_settings(parser.parse_args([])))
    assert defaults.of(MooncakeSettings) == MooncakeSettings() == TransportSettings().of(MooncakeSettings)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-ipc-blocks", "0"])


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_the_first_offer_we_can_reach_wins_in_the_offerers_order():
    ours = [memory.MemoryTransport()]
    offers = [
        Offer("cuda_ipc", "gpu-host", b""),
        Offer("memory", "this-process", b"x"),
        Offer("mooncake", "10.0.0.1", b"y"),
    ]
    offer, transport = pick(offers, ours)
    assert offer.kind == "memory" and transport is ours[0]
    with pytest.raises(TransportError, match=r"no common transport: peer offers \['cuda_ipc'\], we have \['memory'\]"):
        pick(offers[:1], ours)


def test_sender_connects_over_the_shared_transport_and_refuses_other_layouts():
    model = get_preset("tiny-hybrid")
    a = HybridPool(PoolConfig(model, 4, max_tokens=256, max_requests=2))
    b = HybridPool(PoolConfig(model, 4, max_tokens=512, max_requests=2))  # sizes may differ, shapes not
    with (
        PoolEndpoint(memory.MemoryTransport(), a, TransferConfig()) as endpoint,
        PoolEndpoint(memory.MemoryTransport(), b, TransferConfig()) as receiver,
    ):
        sender = KVSender(endpoint)
        offers = [Offer("mooncake", "elsewhere", b"")] + receiver.offers()
        remote = sender.connect(offers, receiver.buffers, receiver.staging_info())
        assert remote.link.kind == "memory" and remote.staging.region == len(receiver.buffers)
        remote.link.probe()
        other = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, max_requests=2))
        with PoolEndpoint(memory.MemoryTransport(), other, TransferConfig()) as stranger:
            with pytest.raises(LayoutIncompatible, match="lacks"):
                sender.connect(stranger.offers(), stranger.buffers)


def test_offers_and_buffers_are_validated_when_decoded():
    """Hostile registrations: a buffer of impossible size or an unknown component does not decode."""
    dec = msgspec.msgpack.Decoder(list[Buffer])
    good = msgspec.msgpack.encode([Buffer(0, 4096, 1024, "full", None, None)])
    assert dec.decode(good)[0].num_items == 4
    for bad in (
        [0, 4096, 1000, "full", None, None],
        [0, 4096, 1024, "bogus", None, None],
        [-1, 4096, 1024, "full", None, None],
        [0, 0, 1024, "full", None, None],
    ):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(msgspec.msgpack.encode([bad]))
    assert "memory" in TRANSPORTS.names()  # registered by the conftest, for the conformance tests


def test_cuda_ipc_reaches_only_its_own_host_and_says_why():
    from transfer.transports.cuda_offer import host_identity, reach_problem

    here = host_identity()
    assert here == host_identity() and "/" in here  # boot id / hostname, stable
    assert reach_problem(Offer("cuda-ipc", here, b""), here) is None
    assert "on another host" in reach_problem(Offer("cuda-ipc", "other-boot/other-host", b""), here)
    assert reach_problem(Offer("mooncake", here, b""), here) == "not cuda-ipc"


def test_a_forced_cuda_ipc_that_cannot_work_is_refused_by_name():
    """Without a GPU the transport cannot start; with one, a CPU pool cannot be exposed."""
    import torch
    from transfer.transports import create

    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="cuda-ipc needs a CUDA device"):
            create(["cuda-ipc"], TransportSettings(device="cuda:0"))
        return
    [cuda] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
    pool = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, max_requests=2, device="cpu"))
    with pytest.raises(TransportError, match="is not CUDA device memory; it needs pools on CUDA"):
        PoolEndpoint(cuda, pool, TransferConfig())


def test_pick_names_why_a_shared_kind_could_not_be_used():
    class SameHostOnly(memory.MemoryTransport):
        def reach_problem(self, offer):
            return None if offer.host == "here" else f"{offer.kind}: the peer is on another host"

    with pytest.raises(TransportError, match=r"no common transport: .* \(memory: the peer is on another host\)"):
        pick([Offer("memory", "there", b"")], [SameHostOnly()])


class _Write(PendingWrite):
    """A write that lands when its own wait() is called (or at once), or fails."""

    def __init__(self, landed=False, error=None, log=None):
        self.nbytes, self.landed, self.error, self.log = 1, landed, error, log if log is not None else []

    def poll(self):
        if self.error:
            raise self.error
        return self.landed

    def wait(self, timeout=None):
        self.log.append(self)
        self.landed = True


def test_pending_writes_on_an_ordered_link_wait_each_write_in_order_and_report_failures_after_all_polled():
    log = []
    first, last = _Write(log=log), _Write(log=log)
    ordered = PendingWrites(ordered=True)
    for w in (first, last):
        ordered.add(w)
    ordered.wait()
    # each in its own wait, in order: a paced CUDA write learns its link's rate from its own end
    assert log == [first, last] and ordered.poll()
    failed, later = _Write(error=WriteFailed("write", -1, "peer", 1)), _Write(landed=True)
    writes = PendingWrites(ordered=True)
    writes.add(failed)
    writes.add(later)
    with pytest.raises(WriteFailed):
        writes.wait()
    assert writes.poll()  # the failed member left the set, the landed one was retired


def test_pending_writes_time_out_with_a_typed_error():
    writes = PendingWrites()
    writes.add(_Write())
    with pytest.raises(WriteFailed, match="not done within"):
        writes.wait(timeout=0.001)


class _Prepared:
    def __init__(self, log, fail=None):
        self.nbytes, self.log, self.fail = 1, log, fail

    def start(self):
        if self.fail:
            raise self.fail
        self.log.append(self)  # started
        self.write = _Write(log=self.log)
        return self.write


def test_a_chain_starts_in_order_and_a_failed_start_drains_what_started_first():
    log = []
    link = memory.MemoryLink.__new__(memory.MemoryLink)  # only its `ordered` and chain() are used
    first, second = _Prepared(log), _Prepared(log)
    started = link.chain([first, second]).start()
    assert log == [first, second], "a chain must start its writes in the order given"
    started.wait()
    assert log[2:] == [first.write, second.write] and started.poll() and started.nbytes == 2
    log.clear()
    failing = link.chain([_Prepared(log), _Prepared(log, fail=WriteFailed("write", -1, "peer", 1))])
    with pytest.raises(WriteFailed):
        failing.start()
    assert len(log) == 2 and log[1].landed, "the write that started was left in flight"


def test_a_chained_write_that_fails_while_landing_fails_the_send_that_holds_it():
    """send() adds a chain's pending writes to its own set: a member's failure (a set raises
    it once) must reach that set's wait, and a member given up on its drain."""
    link = memory.MemoryLink.__new__(memory.MemoryLink)
    body, aux = _Prepared([]), _Prepared([])
    held = PendingWrites(ordered=True)
    held.add(link.chain([body, aux]).start())
    body.write.error = WriteFailed("write", -1, "peer", 1)
    aux.write.landed = True
    with pytest.raises(WriteFailed):
        held.wait()
    abandoned = PendingWrites(ordered=True)
    inner = link.chain([_Prepared([])]).start()
    inner.abandoned = WritesAbandoned("write", -1, "peer", 1, detail="the link closed with writes in flight")
    abandoned.add(inner)
    with pytest.raises(WritesAbandoned):
        abandoned.drain()


def test_an_unordered_link_cannot_chain():
    class Unordered(memory.MemoryLink):
        ordered = False

    with pytest.raises(ValueError, match="does not land writes in order"):
        Unordered.__new__(Unordered).chain([])


def test_a_cuda_ipc_layout_cuts_only_ranges_longer_than_a_piece():
    """Issue 41: expanding a few long ranges on the host cut every range into 256 KiB pieces
    through a dozen numpy calls even when none was longer (an AUX row, page runs). Pure host
    layout (no GPU): each piece is its range's bytes [k * 256 KiB, ...) by definition, and a
    group of short ranges is one copy_ranges launch over (src, dst, len) values."""
    from transfer.transports.cuda_layout import PIECE_BYTES as _PIECE_BYTES, _layout, _split
    from transfer.transports.ranges import RunSet

    ints = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    short = RunSet(ints(0, 10), ints(5, 50), ints(3, 1), ints(0), ints(0), ints(4096))
    long = RunSet(ints(0), ints(0), ints(300), ints(0), ints(1 << 30), ints(4096))  # 1.2 MB: five pieces
    for rs, src_base, dst_base in ((short, ints(1000), ints(2000)), (long, ints(0), ints(1 << 30))):
        got = _split(rs, src_base, dst_base).reshape(3, -1).T.tolist()
        want = []
        for s, d, n in zip(rs.src_start, rs.dst_start, rs.count):
            a, b, length = src_base[0] + s * 4096, dst_base[0] + d * 4096, n * 4096
            want += [[a + k, b + k, min(_PIECE_BYTES, length - k)] for k in range(0, length, _PIECE_BYTES)]
        assert got == want
    values, specs, nbytes = _layout([(short, ints(1000), ints(2000))])
    assert [s[0] for s in specs] == ["copy_ranges"] and nbytes == 4 * 4096 and len(values) == 6
