#!/usr/bin/env python3
"""Transfer benchmark: our data path next to the raw engine ceiling, in one run.

(a) ceiling, measured right before each row (so drift hits both alike): on the CPU the raw
    transport link writing one contiguous block of the same byte count between the same two
    processes; on GPUs a copy of the same bytes, p2p between two GPUs or device-local when both
    pools share one (each row's "ceiling" says which);
(b) our path (KVSender -> harness peer server process) for page sizes 1, 16, 64, both layouts, with
    randomly fragmented pages on both sides, at 2k and 32k tokens (--quick: 2k only); a page
    size P:Q gives prefill pages of P tokens and decode pages of Q (the KV moves by token);
    each row twice: the whole send (planned when called), and the send prepared ahead
    (KVSender.prepare outside the timing, as the prefill server does while the engine
    computes): the time decode waits once the KV is final;
(c) planning time alone for 32k and 128k tokens at page 1 for a 60-layer K/V preset.

    .venv/bin/python scripts/bench_transfer.py [--quick] [--json] [--preset gpt-oss-120b] [--transport mooncake]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the harness package (root first: tests/kvpool is no package)

from harness.peer_client import PeerProcess  # noqa: E402
from harness.peer_server import digest_request, digest_tokens  # noqa: E402
from kvpool import HybridPool, Layout, PoolConfig, get_preset  # noqa: E402
from kvpool.spec import AttentionSpec, ModelSpec  # noqa: E402
from transfer.buffers import buffers_of  # noqa: E402
from transfer.config import Mode, TransferConfig  # noqa: E402
from transfer.plan import build_plan  # noqa: E402
from transfer.endpoint import PoolEndpoint  # noqa: E402
from transfer.sender import KVSender  # noqa: E402
from transfer.transports import TRANSPORTS, Ranges, Transport, TransportSettings, create  # noqa: E402
from transfer.staging import RemoteSlots  # noqa: E402


def shuffle_free_pages(pool: HybridPool, seed: int) -> None:
    """Random page order on the free stacks: every allocation is randomly fragmented."""
    rng = np.random.default_rng(seed)
    for alloc in (pool.pages, getattr(pool.swa_allocator, "swa", None)):
        if alloc is not None:
            rng.shuffle(alloc._stack[: alloc.num_free])


def fill_random(pool: HybridPool, req, seed: int) -> None:
    """Random bytes in every item `req` holds (numpy's generator: GB/s, unlike torch.random_)."""
    rng = np.random.default_rng(seed)
    for p in pool.pools.values():
        _, items = p.held(req)
        data = tuple(
            torch.frombuffer(bytearray(rng.bytes(len(items) * b.shape[1])), dtype=torch.uint8).view(
                len(items), b.shape[1]
            )
            for b in p.storage.buffers
        )
        p.storage.scatter(items, data)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def timed_ahead(sender: KVSender, target, send, repeats: int, **prepare) -> tuple[float, float]:
    """Median seconds of `send(prepared)` with the send prepared just before (not timed), and
    the median prepare time; one warm-up."""
    samples, prep = [], []
    for i in range(repeats + 1):
        t = time.perf_counter()
        prepared = sender.prepare(target, **prepare)
        prep.append(time.perf_counter() - t)
        if str(sender.endpoint.pool.config.device).startswith("cuda"):
            torch.cuda.synchronize()  # its table uploaded, as it would be long before the KV is final
        t = time.perf_counter()
        send(prepared)
        if i:
            samples.append(time.perf_counter() - t)
    return statistics.median(samples), statistics.median(prep[1:])


def bench_layout(
    args,
    transport: Transport,
    peer: PeerProcess,
    layout: Layout,
    page_size: int,
    token_counts: list[int],
    peer_page: int | None = None,
) -> list[dict]:
    """Rows for one (layout, page size) of the sender; `peer_page`: the receiver's, where it
    differs (the KV moves by token, verified per token position)."""
    peer_page = peer_page or page_size
    by_token = peer_page != page_size
    model = get_preset(args.preset)
    capacity = int(max(token_counts) * 2.5)
    cfg = TransferConfig(mode=Mode(args.mode))
    rows = []
    # one peer process serves the whole run, reconfigured per (layout, page size)
    peer.configure(
        args.preset,
        peer_page,
        capacity,
        layout=layout.value,
        max_requests=4,
        staging_slots=cfg.staging_slots,
        staging_slot_mib=cfg.staging_slot_bytes >> 20,
        device=args.peer_device,
    )
    pool = HybridPool(
        PoolConfig(model, page_size, max_tokens=capacity, max_requests=4, layout=layout, device=args.device)
    )
    shuffle_free_pages(pool, 1)
    peer.fragment(2)
    with PoolEndpoint(transport, pool, cfg) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        for tokens in token_counts:
            req = pool.alloc_request(tokens)
            fill_random(pool, req, seed=tokens)
            rid, dst = peer.alloc(tokens)
            src = pool.index_set(req)
            slots = peer.expect(1, rid, want_slots=2)
            plan = sender.plan(target, src, dst, tokens)
            n, t_ceiling, ceiling_kind = _ceiling(args, endpoint, target, plan.nbytes)
            reports = []
            t_ours = timed(
                lambda: reports.append(
                    sender.send(target, src, dst, RemoteSlots(1, slots, peer.channel), num_tokens=tokens)
                ),
                args.repeats,
            )
            digest = digest_tokens if by_token else digest_request
            digest_ok = peer.digest(rid, by_token=by_token).per_component == digest(pool, req)
            fill_random(pool, req, seed=tokens + 1)  # the prepared sends must move the new bytes
            ahead = []
            t_ahead, t_prepare = timed_ahead(
                sender,
                target,
                lambda p: ahead.append(
                    sender.send(target, src, dst, RemoteSlots(1, slots, peer.channel), num_tokens=tokens, prepared=p)
                ),
                args.repeats,
                src=src,
                dst=dst,
                num_tokens=tokens,
                can_stage=True,
            )
            digest_ok = (
                digest_ok
                and all(r.prepared_ahead for r in ahead)
                and peer.digest(rid, by_token=by_token).per_component == digest(pool, req)
            )
            rep = reports[-1]
            ceiling = n / t_ceiling / 1e9
            gbps = rep.nbytes / t_ours / 1e9
            gbps_ahead = rep.nbytes / t_ahead / 1e9
            rows.append(
                {
                    "layout": layout.value,
                    "page_size": page_size,
                    "peer_page_size": peer_page,
                    "tokens": tokens,
                    "mode": Mode(rep.mode).value,
                    "slices": rep.ranges,
                    "plan_ranges": plan.num_ranges,
                    "bytes": rep.nbytes,
                    "gbps": round(gbps, 3),
                    "ceiling_gbps": round(ceiling, 3),
                    "ceiling": ceiling_kind,
                    "ratio": round(gbps / ceiling, 3),
                    "ms": round(t_ours * 1e3, 1),
                    "plan_ms": round(rep.plan_ms, 2),
                    "submit_ms": round(rep.submit_ms, 2),
                    "wait_ms": round(rep.wait_ms, 2),
                    # prepared ahead: what decode waits once the KV is final
                    "ahead_gbps": round(gbps_ahead, 3),
                    "ahead_ratio": round(gbps_ahead / ceiling, 3),
                    "ahead_ms": round(t_ahead * 1e3, 2),
                    "prepare_ms": round(t_prepare * 1e3, 2),
                    "ahead_submit_ms": round(ahead[-1].submit_ms, 2),
                    "verified": digest_ok,
                }
            )
            peer.release(1)
            peer.free(rid)
            pool.free_request(req)
            if not args.json:
                print_row(rows[-1], flush=True)
    return rows


def planning(tokens_list: list[int], repeats: int) -> list[dict]:
    """build_plan alone on meta-device pools (no memory: plans name regions and offsets)."""
    model = ModelSpec("dense-60", 60, full=AttentionSpec(tuple(range(60)), 8, 128, 128))
    out = []
    for layout in Layout:
        for tokens in tokens_list:
            pools = [
                HybridPool(PoolConfig(model, 1, max_tokens=2 * tokens, max_requests=2, layout=layout, device="meta"))
                for _ in range(2)
            ]
            sets, descs = [], []
            for i, pool in enumerate(pools):
                shuffle_free_pages(pool, i)
                sets.append(pool.index_set(pool.alloc_request(tokens)))
                descs.append(buffers_of(pool.buffer_descriptors()))
            plan = build_plan(sets[0], sets[1], descs[0], descs[1])
            t = timed(lambda: build_plan(sets[0], sets[1], descs[0], descs[1]), repeats)
            out.append(
                {
                    "layout": layout.value,
                    "tokens": tokens,
                    "page_size": 1,
                    "layers": 60,
                    "ranges": plan.num_ranges,
                    "ms": round(t * 1e3, 2),
                }
            )
    return out


def print_row(r: dict, flush: bool = False) -> None:
    page = str(r["page_size"]) + (f":{r['peer_page_size']}" if r["peer_page_size"] != r["page_size"] else "")
    print(
        f"{r['layout']:<12} {page:>5} {r['tokens']:>6} {r['mode']:<7} {r['slices']:>7} "
        f"{r['plan_ranges']:>8} {r['gbps']:>6.2f} {r['ceiling_gbps']:>7.2f} {r['ratio']:>6.2f} "
        f"{r['ms']:>8.1f} {r['ahead_ratio']:>6.2f} {r['ahead_ms']:>8.2f} {r['prepare_ms']:>8.2f} "
        f"{'yes' if r['verified'] else 'NO'}",
        flush=flush,
    )


def _ceiling(args, endpoint, target, nbytes: int) -> tuple[int, float, str]:
    """(bytes, seconds, what) of the ceiling beside a row: on two GPUs a p2p copy of the same bytes
    between them; on one GPU (both pools on it) a device-local copy of the same bytes (a
    cuda-ipc write is a device copy there: a one-block link write measured the link's launch
    path, not the memory); on the CPU the raw link writing one contiguous block of the same
    size, pool buffer -> pool buffer."""
    if args.device.startswith("cuda"):
        two = torch.cuda.device_count() > 1
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1" if two else "cuda:0")

        def copy():
            b.copy_(a, non_blocking=True)
            torch.cuda.synchronize("cuda:0")
            if two:
                torch.cuda.synchronize("cuda:1")

        t = timed(copy, max(3, args.repeats))
        del a, b
        return nbytes, t, "p2p copy" if two else "device copy"
    s_buf = max(endpoint.buffers, key=lambda b: b.nbytes)
    d_buf = max(target.buffers, key=lambda b: b.nbytes)
    n = min(nbytes, s_buf.nbytes, d_buf.nbytes)
    one = Ranges.one(s_buf.region, 0, d_buf.region, 0, n)
    return n, timed(lambda: target.link.write(one), max(3, args.repeats)), "raw link"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--quick", action="store_true", help="2k tokens only, fewer repeats (under a minute)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mode", default="auto", choices=[m.value for m in Mode])
    ap.add_argument(
        "--page-sizes",
        default="1,16,64",
        help="comma-separated page sizes; P:Q for prefill P and decode Q (moved by token)",
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="pools and staging areas on both sides (cpu or cuda)")
    ap.add_argument(
        "--transport", default="mooncake", choices=TRANSPORTS.names(), help="the transport under test (both sides)"
    )
    ap.add_argument(
        "--tokens", default=None, help="comma-separated token counts (default: 2048, and 32768 unless --quick)"
    )
    ap.add_argument("--layouts", default="page_major,layer_major")
    TRANSPORTS.add_flags(ap)  # each transport's own (--cuda-ipc-blocks, --mooncake-protocol, ...)
    ap.add_argument(
        "--mooncake-nvlink",
        action="store_true",
        help="Mooncake's intra-node NVLink transport (MC_INTRANODE_NVLINK=1 on both sides)",
    )
    ap.add_argument(
        "--peer-gpu",
        type=int,
        default=None,
        help="the receiver's GPU (CUDA_VISIBLE_DEVICES for its process; default: the second GPU "
        "where there is one); the sender uses --device",
    )
    args = ap.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(1)  # as the peer server: copies must not crowd out the engine's TCP threads
    token_counts = (
        [int(t) for t in args.tokens.split(",")] if args.tokens else ([2048] if args.quick else [2048, 32768])
    )
    if args.mooncake_nvlink:
        os.environ["MC_INTRANODE_NVLINK"] = "1"
    peer_env = dict(os.environ)
    if args.device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        peer_gpu = args.peer_gpu if args.peer_gpu is not None else (1 if gpus > 1 else 0)
        peer_env["CUDA_VISIBLE_DEVICES"] = str(peer_gpu)  # the receiver sees only its GPU, as "cuda"
        args.peer_device = "cuda"
    else:
        args.peer_device = args.device
    [transport] = create([args.transport], TransportSettings("127.0.0.1", args.device, TRANSPORTS.own_settings(args)))
    if not args.json:
        print(
            f"preset {args.preset} on {args.device} over {args.transport}; ceiling = "
            + (
                "a copy of the same bytes (p2p between two GPUs, device-local on one)"
                if args.device.startswith("cuda")
                else "the raw link, one contiguous block of the same bytes, same processes"
            )
        )
        print(
            f"{'layout':<12} {'page':>5} {'tokens':>6} {'mode':<7} {'slices':>7} {'ranges':>8} {'GB/s':>6} "
            f"{'ceiling':>7} {'ratio':>6} {'ms':>8} {'ahead':>6} {'ms':>8} {'prepare':>8} verified"
        )
        print(
            "(ahead: the send prepared beforehand, as while the engine computes: its ratio and ms; prepare: "
            "the ms it took)"
        )
    rows = []
    page_sizes = [tuple(int(x) for x in p.split(":")) for p in args.page_sizes.split(",")]
    with PeerProcess(
        args.preset, page_sizes[0][-1], 4096, transport=args.transport, env=peer_env, device=args.peer_device
    ) as peer:
        for layout in (Layout(name) for name in args.layouts.split(",")):
            for pages in page_sizes:
                rows += bench_layout(args, transport, peer, layout, pages[0], token_counts, pages[-1])
    plan_rows = planning([32768, 131072] if not args.quick else [32768], args.repeats)
    result = {
        "preset": args.preset,
        "device": args.device,
        "transport": args.transport,
        "cuda_ipc_blocks": args.cuda_ipc_blocks,
        "mooncake_nvlink": args.mooncake_nvlink,
        "gpus": torch.cuda.device_count(),
        "ceiling_gbps": round(statistics.median(r["ceiling_gbps"] for r in rows), 3),
        "rows": rows,
        "planning": plan_rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\nplanning (60 layers x K/V, page 1):")
        for p in plan_rows:
            print(f"  {p['layout']:<12} {p['tokens']:>7} tokens {p['ranges']:>9} ranges {p['ms']:>8.2f} ms")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
