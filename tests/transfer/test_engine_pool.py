"""kvpool.engine.EnginePool: KV tensors an engine owns (vLLM's CPU layout, a CUDA-style K/V-first
layout) as layer-major buffers; KVSender and KVReceiver move blocks between two of them in
direct mode (a KVSender into the other's endpoint), byte for byte into the engine's own memory, and nothing else changes. Over the
real Mooncake engine (TCP, loopback) and the in-process memory transport."""

import numpy as np
import pytest
import torch

from harness import memory
from kvpool.engine import EnginePool, EnginePoolConfig, attention_model, block_first, kv_first, shared_pages
from kvpool.errors import SpecError
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.config import Mode, TransferConfig
from transfer.errors import LayoutIncompatible
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender

LAYERS, HEADS, HEAD, BLOCKS = 2, 2, 8, 12
CONFIG = TransferConfig(mode=Mode.DIRECT, staging_slots=1, staging_slot_bytes=4096)


def _cpu(block=16, seed=0):
    """vLLM's CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, block, 2 * HEAD, generator=g) for _ in range(LAYERS)]


def _cuda_style(block=16, seed=0):
    """[2, num_blocks, block_size, num_kv_heads, head_size] per layer (K then V)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, block, HEADS, HEAD, generator=g) for _ in range(LAYERS)]


PAGE = 16 * HEADS * 2 * HEAD * 4  # one block of the CPU layout, float32


def _hybrid(block=16, seed=0):
    """vLLM's hybrid KV cache on CPU: one page pool; layer 0 a GDN state (an int8 view of 600
    bytes per block, its block stride the page), layer 1 attention blocks over the same pages."""
    raw = torch.randint(0, 256, (BLOCKS * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    state = torch.as_strided(raw.view(torch.int8), (BLOCKS, 1, 600), (PAGE, 600, 1))
    return [state, raw.view(torch.float32).view(BLOCKS, HEADS, block, 2 * HEAD)]


def _pages(layer, t):  # a stand-in describe(): _pool passes the hybrid's tensors as one list
    return shared_pages([(i, "page", x) for i, x in enumerate(t)])


LAYOUTS = {"cpu": (_cpu, block_first), "cuda-style": (_cuda_style, kv_first), "hybrid": (_hybrid, _pages)}


def _pool(tensors, describe, block=16) -> EnginePool:
    if describe is _pages:
        bufs = _pages(0, tensors)
    else:
        bufs = [b for layer, t in enumerate(tensors) for b in describe(layer, t)]
    model = attention_model("tiny", range(LAYERS), HEADS, HEAD, torch.float32)
    return EnginePool(EnginePoolConfig(model, block, torch.device("cpu")), bufs)


def _blocks(tensors, layout):
    """Each layer's blocks as rows of bytes (K/V-first: K and V of a block side by side)."""
    if layout == "cpu":
        return [t.view(torch.uint8).view(BLOCKS, -1).clone() for t in tensors]
    if layout == "hybrid":  # every page whole (the state's padding too), once per layer
        return [tensors[1].view(torch.uint8).view(BLOCKS, -1).clone() for _ in range(LAYERS)]
    return [
        torch.cat([t[0].reshape(BLOCKS, -1), t[1].reshape(BLOCKS, -1)], 1).view(torch.uint8).clone() for t in tensors
    ]


@pytest.fixture(params=["mooncake", "memory"])
def transports(request, mooncake):
    if request.param == "mooncake":
        return mooncake, mooncake
    return memory.MemoryTransport(), memory.MemoryTransport()


def _move(transports, layout, src_blocks, dst_blocks, block=16):
    make, describe = LAYOUTS[layout]
    src_t, dst_t = make(block, seed=1), make(block, seed=2)
    before = _blocks(dst_t, layout)
    with (
        PoolEndpoint(transports[0], _pool(src_t, describe, block), CONFIG) as endpoint,
        PoolEndpoint(transports[1], _pool(dst_t, describe, block), CONFIG) as receiver,
    ):
        sender = KVSender(endpoint)
        peer = sender.connect(receiver.offers(), receiver.buffers, receiver.staging_info())
        idx = lambda b: IndexSet({Component.FULL: torch.tensor(b, dtype=torch.int32).numpy()})  # noqa: E731
        report = sender.send(peer, idx(src_blocks), idx(dst_blocks))
        peer.link.close()
    return report, _blocks(src_t, layout), before, _blocks(dst_t, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_land_byte_equal_and_nothing_else_changes(transports, layout):
    src_blocks, dst_blocks = [3, 4, 5, 9], [7, 1, 2, 10]
    report, src, before, after = _move(transports, layout, src_blocks, dst_blocks)
    assert report.mode is Mode.DIRECT
    for layer in range(LAYERS):
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(after[layer][d], src[layer][s]), f"layer {layer}: block {s} -> {d} differs"
        others = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert torch.equal(after[layer][others], before[layer][others]), f"layer {layer}: other blocks changed"


@pytest.mark.parametrize("layout", ["cpu", "cuda-style"])
def test_a_block_size_that_is_not_a_power_of_two_moves_whole_blocks(mooncake, layout):
    """vLLM raises a hybrid model's block size to fit its state in a page (160 for the tiny
    Qwen3-Next): engine pools take any block size (kvpool.spec.check_page_size, engine_blocks),
    and two of one size move whole blocks."""
    src_blocks, dst_blocks = [3, 4, 9], [7, 1, 10]
    _, src, before, after = _move((mooncake, mooncake), layout, src_blocks, dst_blocks, block=160)
    for layer in range(LAYERS):
        assert all(torch.equal(after[layer][d], src[layer][s]) for s, d in zip(src_blocks, dst_blocks))
        others = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert torch.equal(after[layer][others], before[layer][others])


def test_a_prefill_of_any_block_size_registers_and_a_bad_one_is_refused():
    """Decode's SenderRanks builds a prefill rank's claimed shard under its own pool's rule: an
    engine pool of 160 takes a prefill of 160 (whole blocks, no lanes) and one of 12 (by token:
    its lanes: per head of the CPU layout, one per element of K and one for V), and refuses 0 with the reason; a pool of our
    own token rows still refuses 12 (tests/disagg/worker/test_tp_instances)."""
    from disagg.control.layout import LayoutInfo
    from disagg.control.messages import PROTOCOL_VERSION, RegisterPrefill
    from disagg.decode.instances import SenderRanks
    from disagg.errors import ProtocolError
    from transfer.receiver import KVReceiver

    def claim(page_size):
        return RegisterPrefill(PROTOCOL_VERSION, 0, 1, "tcp://127.0.0.1:9", 1, LayoutInfo(page_size, "layer_major", []))

    with PoolEndpoint(memory.MemoryTransport(), _pool(_cpu(160), block_first, 160), CONFIG) as endpoint:
        ranks = SenderRanks(KVReceiver(endpoint))
        assert ranks.lanes(claim(160)) is None and ranks.sender_ranks(claim(160)) == (0,)
        lanes = ranks.lanes(claim(12))[Component.FULL]
        assert [(lane.layer, lane.head, lane.page_size) for lane in lanes] == [
            (layer, h, 160) for layer in range(LAYERS) for h in range(HEADS) for _ in range(HEAD + 1)
        ]
        with pytest.raises(ProtocolError, match="page size 0 is not a positive integer"):
            ranks.lanes(claim(0))


def test_a_shared_page_pool_is_one_buffer_and_overlapping_pages_are_refused():
    assert [(b.layer, tuple(b.blocks.shape)) for b in _pages(0, _hybrid())] == [(0, (BLOCKS, PAGE))]
    whole = torch.zeros(BLOCKS, 2, HEADS, 16, 2 * HEAD)  # [blocks, layers, ...]: BLHNC
    with pytest.raises(SpecError, match="BLHNC"):
        shared_pages([(i, "kv", whole[:, i]) for i in range(2)])


def test_consecutive_blocks_move_as_one_range_per_buffer(transports):
    report, *_ = _move(transports, "cuda-style", [2, 3, 4, 5], [6, 7, 8, 9])
    assert report.ranges == LAYERS * 2  # one run x (K, V) per layer


def test_another_block_size_pairs_only_when_the_receiver_says_its_block_size(mooncake):
    with (
        PoolEndpoint(mooncake, _pool(_cpu(), block_first), CONFIG) as endpoint,
        PoolEndpoint(mooncake, _pool(_cpu(block=32), block_first, block=32), CONFIG) as receiver,
    ):
        sender = KVSender(endpoint)
        with pytest.raises(LayoutIncompatible, match="B/item"):  # taken for ours: its blocks are not
            sender.connect(receiver.offers(), receiver.buffers, receiver.staging_info())
        peer = sender.connect(receiver.offers(), receiver.buffers, receiver.staging_info(), page_size=32)
        assert peer.lanes is not None and peer.page_size == 32
        peer.link.close()
        with pytest.raises(LayoutIncompatible, match="B/item, a block of 64 tokens"):  # a claim its buffers belie
            sender.connect(receiver.offers(), receiver.buffers, receiver.staging_info(), page_size=64)


def test_buffers_are_the_engines_memory_and_bad_tensors_are_refused():
    t = _cuda_style()
    pool = _pool(t, kv_first)
    assert [(d.layer, d.part, d.item_bytes) for d in pool.buffer_descriptors()] == [
        (layer, part, 16 * HEADS * HEAD * 4) for layer in range(LAYERS) for part in ("k", "v")
    ]
    pool.exposed_tensors()[Component.FULL][3][5].fill_(7)  # layer 1's V, block 5
    assert (t[1][1, 5].view(torch.uint8) == 7).all() and not (t[1][0, 5].view(torch.uint8) == 7).all()
    with pytest.raises(SpecError, match="not contiguous"):
        block_first(0, torch.zeros(4, 2, 16, 16).transpose(1, 2))
    with pytest.raises(SpecError, match="blocks"):
        EnginePool(
            pool.config, [*block_first(0, torch.zeros(4, 2, 16, 16)), *block_first(1, torch.zeros(5, 2, 16, 16))]
        )


def test_a_decode_of_another_block_or_tp_size_registers_unless_its_pages_hold_state():
    """vLLM sides of different --block-size or TP register and pair by token; a pool whose
    pages attention and Mamba/GDN state layers share (no_rows: a state moves whole) gets a
    Refused at registration that names both sides' block size and TP and says why."""
    from disagg.control.layout import LayoutInfo, describe_model
    from disagg.control.messages import PROTOCOL_VERSION, RegisterDecode, Refused, Registered
    from disagg.prefill.peers import DecodePeers

    def pool(block, tp=1, no_rows=""):
        tensors = [torch.zeros(BLOCKS, HEADS // tp, block, 2 * HEAD) for _ in range(LAYERS)]
        bufs = [b for layer, t in enumerate(tensors) for b in block_first(layer, t)]
        model = attention_model("tiny", range(LAYERS), HEADS, HEAD, torch.float32)
        return EnginePool(EnginePoolConfig(model, block, torch.device("cpu"), tp, 0), bufs, no_rows=no_rows)

    def info(endpoint):
        pc = endpoint.pool.config
        return LayoutInfo(pc.page_size, pc.layout.value, endpoint.buffers, describe_model(pc.model, pc.tp_size))

    def register(prefill, block, tp):
        peers = DecodePeers(KVSender(prefill), info(prefill), None, 1, 5.0, 1)
        with PoolEndpoint(memory.MemoryTransport(), pool(block, tp), CONFIG) as decode:
            msg = RegisterDecode(
                PROTOCOL_VERSION, 2, info(decode), decode.offers(), decode.staging_info(), tp_size=tp, tp_rank=0
            )
            return peers.register(b"decode", msg)

    with PoolEndpoint(memory.MemoryTransport(), pool(32), CONFIG) as prefill:
        for block, tp in ((16, 1), (160, 1), (32, 2), (32, 1)):
            assert isinstance(register(prefill, block, tp), Registered)
    with PoolEndpoint(memory.MemoryTransport(), pool(32, no_rows="its pages hold state"), CONFIG) as prefill:
        assert isinstance(register(prefill, 32, 1), Registered)
        for block, tp in ((16, 1), (32, 2)):
            answer = register(prefill, block, tp)
            assert isinstance(answer, Refused) and answer.reason == (
                f"block size 32, TP 1 (sender) vs {block}, TP {tp} (receiver): its pages hold state"
            ), answer


def _flashinfer(block=16, seed=0):
    """FlashInfer's CUDA layout, block-first with K and V inside a block: [num_blocks, 2,
    block_size, num_kv_heads, head_size] per layer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, block, HEADS, HEAD, generator=g) for _ in range(LAYERS)]


GPU_LAYOUTS = {
    "flash-attn": (_cuda_style, kv_first),
    "flashinfer": (_flashinfer, block_first),
    "hybrid": (_hybrid, _pages),
}


def _gpu_pool(layout, block, seed):
    """(tensors on the GPU, an EnginePool over them) as a vLLM worker would hand them over."""
    make, describe = GPU_LAYOUTS[layout]
    tensors = [t.cuda() for t in make(block, seed=seed)]
    if layout == "hybrid":  # the state view over the same CUDA storage as the attention blocks
        raw = tensors[1].view(torch.uint8).reshape(-1)
        tensors[0] = torch.as_strided(raw.view(torch.int8), (BLOCKS, 1, 600), (PAGE, 600, 1))
    bufs = _pages(0, tensors) if describe is _pages else [b for i, t in enumerate(tensors) for b in describe(i, t)]
    model = attention_model("tiny", range(LAYERS), HEADS, HEAD, torch.float32)
    return tensors, EnginePool(EnginePoolConfig(model, block, torch.device("cuda:0")), bufs)


def _gpu_rows(layout, tensors):
    return _blocks([t.cpu() for t in tensors], "cpu" if layout == "flashinfer" else layout)


def _gpu_receiver(layout, block, to_parent, from_parent):
    """The decode side in a process of its own (CUDA IPC maps another process's memory)."""
    from transfer.transports import TransportSettings, create

    [transport] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
    tensors, pool = _gpu_pool(layout, block, seed=2)
    with PoolEndpoint(transport, pool, CONFIG) as receiver:
        rows = lambda: [r.numpy() for r in _gpu_rows(layout, tensors)]  # noqa: E731  (by value: no shared files)
        to_parent.put((receiver.offers(), receiver.buffers, receiver.staging_info(), rows()))
        from_parent.get(timeout=120)  # the sender's writes are done
        torch.cuda.synchronize()
        to_parent.put(rows())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,block", [("flash-attn", 16), ("flash-attn", 160), ("flashinfer", 16), ("flashinfer", 160), ("hybrid", 16)]
)
def test_the_connectors_cuda_layouts_move_over_cuda_ipc_on_a_gpu(layout, block):
    """What a vLLM connector hands over on a GPU (FlashAttention's K/V-first tensors,
    FlashInfer's block-first ones, a hybrid model's shared page pool; blocks of 16 and a hybrid
    model's 160), moved over cuda-ipc into engine pools of another process: the blocks asked
    for land byte for byte and every other block is untouched (the upstream CUDA vLLM cannot
    run here: this is the GPU side of issue 34)."""
    import multiprocessing

    from transfer.transports import TransportSettings, create

    ctx = multiprocessing.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_gpu_receiver, args=(layout, block, to_parent, from_parent), daemon=True)
    child.start()
    try:
        offers, buffers, staging, before = to_parent.get(timeout=120)
        [transport] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
        src_t, src_pool = _gpu_pool(layout, block, seed=1)
        src_blocks, dst_blocks = [3, 4, 5, 9], [7, 1, 2, 10]
        with PoolEndpoint(transport, src_pool, CONFIG) as endpoint:
            sender = KVSender(endpoint)
            peer = sender.connect(offers, buffers, staging)
            idx = lambda b: IndexSet({Component.FULL: np.array(b, dtype=np.int32)})  # noqa: E731
            report = sender.send(peer, idx(src_blocks), idx(dst_blocks))
            peer.link.close()
        from_parent.put("sent")
        after = to_parent.get(timeout=120)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert report.mode is Mode.DIRECT and report.transport == "cuda-ipc", report
    before, after = [torch.from_numpy(r) for r in before], [torch.from_numpy(r) for r in after]
    src, others = _gpu_rows(layout, src_t), [b for b in range(BLOCKS) if b not in dst_blocks]
    for layer in range(LAYERS):
        assert all(torch.equal(after[layer][d], src[layer][s]) for s, d in zip(src_blocks, dst_blocks)), layer
        assert torch.equal(after[layer][others], before[layer][others]), f"layer {layer}: other blocks changed"


# ---- other block sizes and TP sizes: an engine's blocks as token rows (transfer.engine_rows) ----

RESHARD_HEADS, TOKENS = 4, 100  # 2 heads a rank at TP 2 (two head-outer lanes a layer); a last block part full


def _rows_layout(layout, block, heads, seed):
    """A side's tensors per layer (heads: this rank's) and accessors of a token's K and V."""
    g = torch.Generator().manual_seed(seed)
    if layout == "cpu":  # [blocks, heads, block_size, 2 * head]
        make = lambda: torch.randn(BLOCKS, heads, block, 2 * HEAD, generator=g)  # noqa: E731
        return [make() for _ in range(LAYERS)], block_first, _cpu_cell
    if layout == "flashinfer":  # [blocks, 2, block_size, heads, head]
        make = lambda: torch.randn(BLOCKS, 2, block, heads, HEAD, generator=g)  # noqa: E731
        return [make() for _ in range(LAYERS)], block_first, lambda t, kv, b, s: t[b, kv, s]
    make = lambda: torch.randn(2, BLOCKS, block, heads, HEAD, generator=g)  # noqa: E731  (K/V-first)
    return [make() for _ in range(LAYERS)], kv_first, lambda t, kv, b, s: t[kv, b, s]


def _cpu_cell(t, kv, b, s):
    """K (kv 0) or V of slot s of block b, every head: [heads, head] (a view). vLLM's CPU kernels
    keep a head's K dim-major ([head, block_size]: one element of every token back to back),
    then its V a row a token, whatever the tensor's shape [blocks, heads, block_size, 2 * head]
    says (tests/vllm_connector/test_layout.py checks this against the kernel itself)."""
    heads, block = t.shape[1], t.shape[2]
    halves = t[b].view(heads, 2, block * HEAD)
    return halves[:, 0].view(heads, HEAD, block)[:, :, s] if kv == 0 else halves[:, 1].view(heads, block, HEAD)[:, s]


class _Side:
    """One TP rank of one side: its engine tensors, their pool, the blocks of a request."""

    def __init__(self, layout, block, tp, rank, blocks, seed, device="cpu"):
        self.block, self.tp, self.rank, self.blocks = block, tp, rank, blocks
        self.heads = RESHARD_HEADS // tp
        self.tensors, describe, self.cell = _rows_layout(layout, block, self.heads, seed)
        self.tensors = [t.to(device) for t in self.tensors]
        bufs = [b for i, t in enumerate(self.tensors) for b in describe(i, t)]
        model = attention_model("tiny", range(LAYERS), RESHARD_HEADS, HEAD, torch.float32)
        self.pool = EnginePool(EnginePoolConfig(model, block, torch.device(device), tp, rank), bufs)

    @property
    def first(self) -> int:
        """The first position its blocks hold (they are the request's last: a prefix is its own)."""
        return (-(-TOKENS // self.block) - len(self.blocks)) * self.block

    def at(self, layer, kv, p, tensors=None):
        """K (kv 0) or V of position p, this rank's heads: [heads, head] (a view)."""
        assert p >= self.first
        b = self.blocks[(p - self.first) // self.block]
        return self.cell((tensors or self.tensors)[layer], kv, b, p % self.block)


class _Chunks:
    """A receiver's side of a staged send: real ZMQ PAIR sockets (inproc) carrying the chunk
    notices; a thread scatters each into the receiver's pool (KVReceiver.on_chunk) and acks."""

    def __init__(self, receiver, dst, leased, lanes, prefix_len):
        import threading

        import zmq

        from harness.pair_channel import PairChannel

        self.ctx = zmq.Context()
        a, b = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        a.bind(f"inproc://chunks-{id(self)}")
        b.connect(f"inproc://chunks-{id(self)}")
        self.sender, self.mine, self.stop, self.errors = PairChannel(a), PairChannel(b), threading.Event(), []
        self.args = (receiver, dst, leased, lanes, prefix_len)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        from disagg.control.messages import ChunkDone
        from transfer.errors import StagingError

        receiver, dst, leased, lanes, prefix_len = self.args
        while not self.stop.is_set():
            try:
                n = self.mine.recv_notice(0.05)
            except StagingError:
                continue
            try:
                receiver.on_chunk(n.index, n.slot, n.pieces, dst, leased, TOKENS, lanes=lanes, prefix_len=prefix_len)
            except Exception as exc:  # the test fails on it: the sender times out waiting for the ack
                self.errors.append(exc)
                continue
            self.mine.send_done(ChunkDone(n.transfer_id, n.index))

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


STAGED = TransferConfig(mode=Mode.STAGED, staging_slots=2, staging_slot_bytes=16384, chunk_timeout_s=10.0)


def _send(transport, src: _Side, dst: _Side, remote, mode, receiver=None):
    """Source rank `src` sends the request into decode rank `dst`, whose endpoint offers
    `remote` = (offers, buffers, staging info): direct, or staged through the slots of its
    `receiver` (in this process) and the chunk channel."""
    from transfer.staging import RemoteSlots

    idx = lambda b: IndexSet({Component.FULL: np.array(b, dtype=np.int32)})  # noqa: E731
    config = CONFIG if mode is Mode.DIRECT else STAGED
    with PoolEndpoint(transport, src.pool, config) as endpoint:
        sender = KVSender(endpoint)
        peer = sender.connect(*remote, page_size=dst.block, tp=(dst.tp, dst.rank))
        assert peer.lanes is not None, "moves by token"
        remote, chunks = None, None
        if mode is Mode.STAGED:
            shard = src.pool.config.shard
            leased = receiver.reserve_slots(2)
            chunks = _Chunks(receiver, idx(dst.blocks), leased, receiver.lanes_from(shard), dst.first)
            remote = RemoteSlots(1, leased, chunks.sender)
        try:
            report = sender.send(
                peer, idx(src.blocks), idx(dst.blocks), remote, num_tokens=TOKENS, prefix_len=dst.first
            )
        finally:
            peer.link.close()
            if chunks is not None:
                chunks.close()
                receiver.release_slots(remote.slots)
                assert not chunks.errors, chunks.errors
    assert report.mode is mode, report
    return report


def _reshard(transport, layout, blocks, tp, dst_blocks, mode):
    """Every decode rank of tp[1] receives from the prefill ranks of tp[0] that hold its heads;
    each rank's tensors must equal what they were with exactly the moved cells (the positions
    its blocks cover, its heads) replaced by the source's: byte-equal, nothing else touched."""
    from transfer.receiver import KVReceiver
    from transfer.reshard import senders

    sources = _sources(layout, blocks[0], tp[0])
    model = sources[0].pool.config.model
    for d in range(tp[1]):
        dst = _Side(layout, blocks[1], tp[1], d, dst_blocks, seed=20 + d)
        want = _want(dst, dst.tensors, sources, [s.tensors for s in sources])
        with PoolEndpoint(transport, dst.pool, STAGED) as endpoint:
            receiver = KVReceiver(endpoint)
            ranks = senders(model, tp[0], dst.pool.config.shard, (Component.FULL,))
            assert len(ranks) == max(1, tp[0] // tp[1])
            for r in ranks:
                remote = (endpoint.offers(), endpoint.buffers, endpoint.staging_info())
                _send(transport, sources[r], dst, remote, mode, receiver)
        for layer in range(LAYERS):
            assert torch.equal(dst.tensors[layer], want[layer]), f"decode rank {d}, layer {layer}"


def _sources(layout, block, tp, device="cpu"):
    """The prefill ranks of TP size `tp`, each holding the request in the same blocks."""
    ids = [3, 7, 1, 10, 5, 2, 8][: -(-TOKENS // block)]
    return [_Side(layout, block, tp, r, ids, seed=10 + r, device=device) for r in range(tp)]


def _want(dst: _Side, before, sources, source_tensors):
    """Decode rank `dst`'s tensors after the transfer: `before` with exactly the moved cells
    (the positions its blocks hold, its heads) replaced by the source rank's holding them."""
    want = [t.clone() for t in before]
    for layer in range(LAYERS):
        for p in range(dst.first, TOKENS):
            for kv in (0, 1):
                for h in range(dst.heads):  # local head h of decode rank d = global head g
                    g = dst.rank * dst.heads + h
                    r = g // sources[0].heads
                    dst.at(layer, kv, p, want)[h] = sources[r].at(layer, kv, p, source_tensors[r])[g % sources[r].heads]
    return want


ROW_LAYOUTS = ["cpu", "flashinfer", "cuda-style"]


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize(
    "blocks,dst_blocks",
    [((32, 64), [9, 4]), ((64, 32), [6, 11]), ((48, 32), [2, 9, 4, 6])],
    ids=["32-to-64", "64-to-32-suffix", "48-to-32"],
)
def test_engine_blocks_of_another_block_size_move_by_token(mooncake, layout, blocks, dst_blocks, mode):
    """vLLM sides started with different --block-size: decode's blocks (64 -> 32: only its last
    two, a prefix it holds) get the positions they cover, token by token, over Mooncake TCP; 48
    and 32 do not divide each other (runs end at either side's block ends)."""
    _reshard(mooncake, layout, blocks, (1, 1), dst_blocks, mode)


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize(
    "tp,blocks,dst_blocks",
    [((1, 2), (32, 32), [9, 4, 6, 2]), ((2, 1), (32, 32), [9, 4, 6, 2]), ((1, 2), (32, 64), [9, 4])],
    ids=["tp1-to-2", "tp2-to-1", "tp1-to-2-and-32-to-64"],
)
def test_engine_blocks_move_between_tp_sizes_by_head(mooncake, layout, tp, blocks, dst_blocks, mode):
    """TP 1 -> 2: each decode rank gets its two heads from the one prefill rank; 2 -> 1: the
    decode rank gets each half of its heads from the prefill rank holding it (the CPU layout
    pairs a lane per head, the others slices of each token's row)."""
    _reshard(mooncake, layout, blocks, tp, dst_blocks, mode)


def _gpu_rank_receiver(layout, block, tp, rank, blocks, to_parent, from_parent):
    """A decode rank on the GPU in a process of its own (cuda-ipc maps another process's memory)."""
    from transfer.transports import TransportSettings, create

    [transport] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
    dst = _Side(layout, block, tp, rank, blocks, seed=20 + rank, device="cuda:0")
    with PoolEndpoint(transport, dst.pool, CONFIG) as receiver:
        host = lambda: [t.cpu().numpy() for t in dst.tensors]  # noqa: E731  (by value: no shared files)
        to_parent.put((receiver.offers(), receiver.buffers, receiver.staging_info(), host()))
        from_parent.get(timeout=120)  # the senders' writes are done
        torch.cuda.synchronize()
        to_parent.put(host())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,blocks,tp,dst_blocks",
    [
        ("cuda-style", (16, 32), (1, 1), [9, 4, 6, 2]),
        ("flashinfer", (32, 16), (1, 1), [2, 9, 4]),  # a decode prefix: its last 3 blocks of 7
        ("cuda-style", (16, 16), (1, 2), [9, 4, 6, 2, 11, 1, 5]),
        ("flashinfer", (16, 160), (2, 1), [5]),
    ],
    ids=["flash-attn-16-to-32", "flashinfer-32-to-16-suffix", "flash-attn-tp1-to-2", "flashinfer-tp2-to-1-16-to-160"],
)
def test_the_connectors_cuda_layouts_pair_other_block_and_tp_sizes_over_cuda_ipc(layout, blocks, tp, dst_blocks):
    """The GPU side of other block and TP sizes: FlashAttention's K/V-first and FlashInfer's
    block-first blocks move by token over cuda-ipc into engine pools of another process (a
    decode rank each): every position its blocks hold, its heads, byte-equal; nothing else."""
    import multiprocessing

    from transfer.reshard import senders
    from transfer.transports import TransportSettings, create

    ctx = multiprocessing.get_context("spawn")
    [transport] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
    sources = _sources(layout, blocks[0], tp[0], device="cuda:0")
    model = sources[0].pool.config.model
    for d in range(tp[1]):
        to_parent, from_parent = ctx.Queue(), ctx.Queue()
        args = (layout, blocks[1], tp[1], d, dst_blocks, to_parent, from_parent)
        child = ctx.Process(target=_gpu_rank_receiver, args=args, daemon=True)
        child.start()
        try:
            *remote, before = to_parent.get(timeout=120)
            dst = _Side(layout, blocks[1], tp[1], d, dst_blocks, seed=0)  # its geometry, on the host
            for r in senders(model, tp[0], dst.pool.config.shard, (Component.FULL,)):
                report = _send(transport, sources[r], dst, remote, Mode.DIRECT)
                assert report.transport == "cuda-ipc", report
            from_parent.put("sent")
            after = [torch.from_numpy(t) for t in to_parent.get(timeout=120)]
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        host = [[t.cpu() for t in s.tensors] for s in sources]
        want = _want(dst, [torch.from_numpy(t) for t in before], sources, host)
        for layer in range(LAYERS):
            assert torch.equal(after[layer], want[layer]), f"decode rank {d}, layer {layer}"
