#!/usr/bin/env python3
"""TP resharding benchmark: N prefill ranks into M decode ranks, every pair at once, beside
the 1 -> 1 transfer of the same bytes (same model, same tokens).

Each of the N prefill ranks is a process of its own (harness.sender_server; --senders
process, the default, on the CPU and on a GPU: every rank's pool on the one GPU, written
into the decode ranks' pools over cuda-ipc as the transport does between workers), as
deployments and the demo run them, its pool written by the stand-in engine (a rank's bytes
are its heads of the whole model's row); or, with --senders thread, all N pools live in this
process, one GIL for every send (on one H100 that made 8:1 5.6x of 1:1: host work per send
times N, which no deployment has). Each of the M decode ranks is a harness peer process (its own pool of TP size M).
Every (prefill rank, decode rank) pair that has slices to move sends concurrently, a thread
each in its rank's process; a decode rank is done when all its senders are (by the wall
clock the reports end at). Every decode rank then checks its KV with the stand-in's verify
(byte for byte).

    per decode rank  bytes it received / time until its last sender finished
    aggregate        all bytes / the wall time of the whole exchange
    x_1to1           wall time / the 1 -> 1 row's of the same layout and page sizes (the issue
                     40 bar: <= 1.5); x_equal_pages: / the 1 -> 1 row of equal page sizes
    ahead_ms         the same sends, each laid out before its timed start (--prepare-ahead, the
                     default) as a prefill worker lays it out while the KV computes (plan, writes, a
                     fan-out's table): what decode waits once the KV is final; x_1to1_ahead: / the
                     1 -> 1 row's ahead_ms. The decode pages are overwritten with garbage before
                     these sends and verified after them
    ratio            aggregate / the equal-TP row's (first N:N in --tp) of the same group
    sender_ms_median where the senders' time went (plan, prepare, submit, wait; the report's fields)
    host_cpu_ms      CPU time of one repeat over every process of the row (senders, decode ranks,
                     this one; clock ticks of /proc): near ms x cores, the host's cores were the bound;
                     host_cpu_ms_by_role: the same split (senders, decode, bench)

    .venv/bin/python scripts/bench_tp.py [--tp 1:1,2:1,4:1,8:1,1:8,8:2] [--tokens 4096]
                                         [--page-sizes 16,64:16] [--device cuda] [--json]
                                         [--senders process|thread] [--scatter-workers 4]
                                         [--staging-chunk-kib 2048]
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the harness package (root first: tests/kvpool is no package)

from disagg.engine.standin import StandInEngine  # noqa: E402
from disagg.worker.flags import STAGING_SLOTS  # noqa: E402
from harness.peer_client import PeerProcess  # noqa: E402
from harness.sender_client import SenderProcess  # noqa: E402
from harness.wire import SendTo  # noqa: E402
from kvpool import HybridPool, Layout, PoolConfig, get_preset  # noqa: E402
from kvpool.geometry import components  # noqa: E402
from transfer.config import Mode, TransferConfig  # noqa: E402
from transfer.reshard import Shard, senders as senders_of  # noqa: E402
from transfer.endpoint import PoolEndpoint  # noqa: E402
from transfer.sender import KVSender  # noqa: E402
from transfer.transports import TRANSPORTS, TransportSettings, create  # noqa: E402
from transfer.staging import RemoteSlots  # noqa: E402


class ThreadRanks:
    """--senders thread: the N prefill pools in this process, a thread per send (one GIL: it
    measures host work per send times N, which no deployment has)."""

    def __init__(self, args, transport, n: int, layout: Layout, tokens: int, ids: np.ndarray, cfg: TransferConfig):
        model, self.tokens = get_preset(args.preset), tokens
        self.prefill = []
        for r in range(n):
            pool = HybridPool(
                PoolConfig(
                    model,
                    args.page_size,
                    max_tokens=int(tokens * 2.5),
                    max_requests=2,
                    layout=layout,
                    tp_size=n,
                    tp_rank=r,
                    device=args.device,
                )
            )
            req = pool.alloc_request(tokens)
            StandInEngine().prefill(pool, req, ids, ROOM)
            self.prefill.append((pool, req))
        self.endpoints = [PoolEndpoint(transport, pool, cfg) for pool, _ in self.prefill]
        self.senders = [KVSender(e) for e in self.endpoints]

    def link(self, pairs, peers) -> None:
        self.peers = peers
        self.links = {(r, s): peers[s].connect(self.senders[r]) for r, s in pairs}

    def send_all(self, pairs, targets, slots, ahead: bool = False) -> tuple[float, dict]:
        """Every pair's send at once; (wall clock at the start, report per pair). `ahead`: each
        send laid out first (KVSender.prepare, as a worker does while the KV computes), untimed."""
        reports, errors = {}, []
        remote = {(r, s): RemoteSlots(1 + r, slots[r, s], self.peers[s].channel) for r, s in pairs}
        prepared = {
            (r, s): self.senders[r].prepare(
                self.links[r, s],
                self._src(r),
                targets[s][1],
                self.tokens,
                False,
                KVSender.can_stage(self.links[r, s], remote[r, s]),
            )
            for r, s in (pairs if ahead else ())
        }

        def one(r, s):
            try:
                reports[r, s] = self.senders[r].send(
                    self.links[r, s],
                    self._src(r),
                    targets[s][1],
                    remote[r, s],
                    num_tokens=self.tokens,
                    prepared=prepared.get((r, s)),
                )
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=p) for p in pairs]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return t0, reports

    def _src(self, r: int):
        pool, req = self.prefill[r]
        return pool.index_set(req)

    def pids(self) -> list[int]:
        return []  # (the senders are threads of this process)

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()


class ProcessRanks:
    """--senders process: each prefill rank in a process of its own (harness.sender_server),
    as deployments and the demo run them; each (rank, decode rank) pair has its own chunk
    channel (the decode rank's channel 1 + rank)."""

    def __init__(self, args, transport, n: int, layout: Layout, tokens: int, ids: np.ndarray, cfg: TransferConfig):
        procs = [
            SenderProcess(
                args.preset,
                args.page_size,
                tokens,
                (n, r),
                layout=layout.value,
                seed=tokens,
                room=ROOM,
                mode=args.mode,
                staging_slots=cfg.staging_slots,
                device=args.device,
                transport=args.transport,
                flags=(
                    "--cuda-ipc-blocks",
                    str(args.cuda_ipc_blocks),
                    "--staging-chunk-kib",
                    str(args.staging_chunk_kib),
                    "--mooncake-engines",
                    str(args.mooncake_engines),
                ),
            )
            for r in range(n)
        ]
        try:
            self.procs = [p.ready(300.0) for p in procs]  # (N CUDA contexts start at once on a GPU)
        except BaseException:
            for p in procs:
                p.close()
            raise

    def link(self, pairs, peers) -> None:
        for r, s in pairs:
            self.procs[r].link(s, peers[s].target(), peers[s].channels[1 + r])

    def send_all(self, pairs, targets, slots, ahead: bool = False) -> tuple[float, dict]:
        by_rank: dict[int, list] = {}
        for r, s in pairs:
            arrays = {c.value: targets[s][1][c].astype(np.int32).tobytes() for c in targets[s][1].components()}
            by_rank.setdefault(r, []).append((s, SendTo(s, 1 + r, arrays, list(slots[r, s]))))
        for r, sends in by_rank.items() if ahead else ():  # (untimed: a worker does it while the KV computes)
            self.procs[r].prepare([x for _, x in sends])
        t0 = time.time()
        for r, sends in by_rank.items():
            self.procs[r].start_send([x for _, x in sends])
        reports = {}
        for r, sends in by_rank.items():
            for (s, _), rep in zip(sends, self.procs[r].finish_send().reports):
                reports[r, s] = rep
        return t0, reports

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            p.close()


ROOM = 11


def _mps_daemon() -> bool:
    """Whether an MPS control daemon runs here (its pipe: CUDA's default place, or the
    variable that moves it): without one the GPU time-slices the ranks' processes (README)."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control").exists()


def run_pair(args, transport, peers, n: int, m: int, layout: Layout, tokens: int) -> dict:
    model = get_preset(args.preset)
    capacity = int(tokens * 2.5)  # room for every SWA page of the prompt at swa_ratio 0.5
    ids = np.random.default_rng(tokens).integers(0, 50000, tokens)
    cfg = TransferConfig(  # a worker's defaults
        mode=Mode(args.mode), staging_slots=STAGING_SLOTS, staging_chunk_bytes=args.staging_chunk_kib << 10
    )
    targets, pairs = [], []
    for s, peer in enumerate(peers[:m]):
        peer.configure(
            args.preset,
            args.peer_page,
            capacity,
            layout=layout.value,
            max_requests=2,
            staging_slots=2 * n,
            staging_slot_mib=cfg.staging_slot_bytes >> 20,  # 2 per sender
            device=args.peer_device,
            tp=(m, s),
        )
        targets.append(peer.alloc(tokens))
        pairs += [(r, s) for r in senders_of(model, n, Shard(args.peer_page, m, s), components(model))]
    ranks = (ProcessRanks if args.senders == "process" else ThreadRanks)(args, transport, n, layout, tokens, ids, cfg)
    try:
        ranks.link(pairs, peers)
        slots = {
            (r, s): peers[s].expect(1 + r, targets[s][0], want_slots=2, sender=(args.page_size, n, r)) for r, s in pairs
        }
        ranks.send_all(pairs, targets, slots)  # a warm-up
        roles = {"senders": ranks.pids(), "decode": [p.proc.pid for p in peers[:m]], "bench": [os.getpid()]}
        cpu0 = {k: _cpu_s(v) for k, v in roles.items()}
        samples = [ranks.send_all(pairs, targets, slots) for _ in range(args.repeats)]
        cpu = {k: (_cpu_s(v) - cpu0[k]) / args.repeats if cpu0[k] is not None else None for k, v in roles.items()}
        for s in range(m):
            peers[s].verify(targets[s][0], ids, ROOM)
        row = _row(args, n, m, layout, tokens, pairs, samples)
        if args.prepare_ahead:
            row.update(_ahead(args, ranks, peers[:m], pairs, targets, slots, ids, tokens))
        for r, s in pairs:
            peers[s].release(1 + r)
        known = None not in cpu.values()
        row["host_cpu_ms"] = round(sum(cpu.values()) * 1e3, 1) if known else None
        row["host_cpu_ms_by_role"] = {k: round(v * 1e3, 1) for k, v in cpu.items()} if known else None
        return row
    finally:
        for s, (rid, _) in enumerate(targets):
            peers[s].free(rid)
        ranks.close()


def _ahead(args, ranks, peers, pairs, targets, slots, ids, tokens: int) -> dict:
    """The same sends, each laid out before its timed start as a prefill worker lays it out
    while the KV computes (plan, writes, a fan-out's table): what decode waits for once the KV
    is final. The decode ranks' pages are overwritten with garbage first, so the verify after
    proves these sends moved every byte."""
    for s, peer in enumerate(peers):
        peer.fill(targets[s][0], ids, ROOM, tokens, garbage=True)
    samples = [ranks.send_all(pairs, targets, slots, ahead=True) for _ in range(args.repeats)]
    for s, peer in enumerate(peers):
        peer.verify(targets[s][0], ids, ROOM)
    if not all(rep.prepared_ahead for _, reports in samples for rep in reports.values()):
        raise RuntimeError("a send prepared ahead did not start from what was prepared")
    wall, t0, reports = _median(samples)
    return {
        "ahead_ms": round(wall * 1e3, 2),
        "ahead_sender_ms_median": _phases([reports[p] for p in pairs]),
        "ahead_timeline_ms": _timeline(t0, pairs, reports),
    }


def _cpu_s(pids: list[int]) -> float | None:
    """CPU seconds (user + system, every thread) the processes `pids` have used so far (None
    where /proc does not say): a row's host_cpu_ms is what one repeat cost the whole host,
    senders, decode ranks and this process together; beside its ms it says whether the host's
    cores were the bound (host_cpu_ms / ms near the core count)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    return total / tick


def _row(args, n: int, m: int, layout: Layout, tokens: int, pairs, samples) -> dict:
    """The row of the median-wall repeat: per decode rank bytes / time until its last sender
    ended, aggregate bytes / wall, where the senders' time went."""
    wall, t0, reports = _median(samples)
    by_rank = [sum(reports[p].nbytes for p in pairs if p[1] == s) for s in range(m)]
    rank_gbps = [by_rank[s] / (max(reports[p].end_at for p in pairs if p[1] == s) - t0) / 1e9 for s in range(m)]
    return {
        "tp": f"{n}:{m}",
        "layout": layout.value,
        "page_size": args.page_size,
        "decode_page_size": args.peer_page,
        "tokens": tokens,
        "senders": len(pairs),
        "sender_processes": args.senders == "process",
        "mode": sorted({Mode(rep.mode).value for rep in reports.values()}),
        "ranges_per_request": sum(reports[p].ranges for p in pairs),
        "bytes": sum(by_rank),
        "ms": round(wall * 1e3, 2),
        "aggregate_gbps": round(sum(by_rank) / wall / 1e9, 2),
        "per_decode_rank_gbps": [round(g, 2) for g in rank_gbps],
        "verified": True,
        "sender_ms_median": _phases([reports[p] for p in pairs]),
        "timeline_ms": _timeline(t0, pairs, reports),
    }


def _median(samples) -> tuple[float, float, dict]:
    """The median-wall repeat of `samples` ((t0, report per pair) each): (wall, t0, reports)."""
    walls = [max(rep.end_at for rep in reports.values()) - t0 for t0, reports in samples]
    wall = statistics.median_low(walls)
    return (wall, *samples[walls.index(wall)])


def _timeline(t0: float, pairs, reports) -> list[list]:
    """Per sender of the median repeat, ms after the row's start: [rank, decode rank, began,
    first write (None: none), ended]: the spread of `began` is the start skew, the gaps between ends what
    the senders' writes queued behind (on one GPU, other processes' kernels)."""
    out = []
    for r, s in sorted(pairs, key=lambda p: reports[p].end_at):
        rep = reports[r, s]
        began = rep.end_at - rep.transfer_ms / 1e3
        out.append([r, s, *(round((x - t0) * 1e3, 2) if x else None for x in (began, rep.first_write_at, rep.end_at))])
    return out


def _phases(reports) -> dict:
    """Where the senders' time went (TransferReport fields), the median over senders of the
    last repeat: plan and prepare (host, before any write), submit (starting the writes),
    wait (until they landed)."""
    keys = ("transfer_ms", "plan_ms", "prepare_ms", "submit_ms", "wait_ms", "cpu_ms")
    return {k: round(statistics.median(getattr(r, k) for r in reports), 2) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument(
        "--tp",
        default="1:1,2:1,4:1,8:1,1:8,8:2",
        help="prefill:decode TP sizes; 1:1 is the reference, the first N:N the equal-TP baseline",
    )
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument(
        "--page-sizes",
        "--page-size",
        default="16,64:16",
        metavar="P[:Q],...",
        help="tokens per page, one group of rows each: P on both sides, or P on prefill and Q on decode",
    )
    ap.add_argument("--layouts", default="page_major")
    ap.add_argument("--mode", default="auto", choices=[m.value for m in Mode])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="mooncake", choices=TRANSPORTS.names())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--senders",
        choices=["process", "thread"],
        default=None,
        help="each prefill rank's sender in a process of its own (as deployed; the default; on a GPU every "
        "rank's pool on the same GPU, shared with the decode ranks by CUDA IPC) or all ranks in this "
        "process, a thread per send (one GIL: host work per send times N)",
    )
    ap.add_argument(
        "--scatter-workers",
        type=int,
        default=4,
        help="threads scattering staged chunks in each decode rank (decode's --scatter-workers)",
    )
    ap.add_argument(
        "--staging-chunk-kib",
        type=int,
        default=0,
        help="the senders' staged chunk size, KiB (prefill's --staging-chunk-kib; 0: a whole slot)",
    )
    ap.add_argument(
        "--prepare-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the sends planned inline, the same sends each laid out before its timed start, as a "
        "prefill worker lays them out while the KV computes (ahead_ms, x_1to1_ahead: what decode waits "
        "once the KV is final)",
    )
    ap.add_argument("--json", action="store_true")
    TRANSPORTS.add_flags(ap)  # each transport's own (--cuda-ipc-blocks: the senders' copy kernel)
    args = ap.parse_args()
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.tp.split(",")]
    groups = [(int(p), int(q or p)) for p, _, q in (g.partition(":") for g in args.page_sizes.split(","))]
    env = dict(os.environ)
    args.peer_device = "cuda" if args.device.startswith("cuda") else args.device
    args.senders = args.senders or "process"
    # this process's own transport only for thread senders (a sender process makes its own: on a
    # GPU this process then holds no CUDA context of its own)
    transport = (
        create([args.transport], TransportSettings("127.0.0.1", args.device, TRANSPORTS.own_settings(args)))[0]
        if args.senders == "thread"
        else None
    )
    rows = []
    peers = PeerProcess.start_many(  # at once: a host slow to start Python + torch pays one start, not M
        max(m for _, m in pairs),
        start_timeout=300.0,
        preset=args.preset,
        page_size=groups[0][1],
        tokens=4096,
        transport=args.transport,
        env=env,
        device=args.peer_device,
        chunk_channels=1 + max(n for n, _ in pairs),
        scatter_workers=args.scatter_workers,
        flags=("--mooncake-engines", str(args.mooncake_engines)),
    )
    try:
        for layout in (Layout(x) for x in args.layouts.split(",")):
            equal_pages_ms = None
            for args.page_size, args.peer_page in groups:
                base = one_ms = one_ahead = None
                for n, m in pairs:
                    row = run_pair(args, transport, peers, n, m, layout, args.tokens)
                    one_ms = one_ms or (row["ms"] if (n, m) == (1, 1) else None)
                    if args.page_size == args.peer_page:
                        equal_pages_ms = equal_pages_ms or one_ms
                    base = base or (row["aggregate_gbps"] if n == m else None)
                    row["ratio_to_equal_tp"] = round(row["aggregate_gbps"] / base, 2) if base else None
                    row["x_1to1"] = round(row["ms"] / one_ms, 2) if one_ms else None
                    row["x_equal_pages"] = round(row["ms"] / equal_pages_ms, 2) if equal_pages_ms else None
                    one_ahead = one_ahead or (row.get("ahead_ms") if (n, m) == (1, 1) else None)
                    if "ahead_ms" in row:
                        row["x_1to1_ahead"] = round(row["ahead_ms"] / one_ahead, 2) if one_ahead else None
                    rows.append(row)
                    if not args.json:
                        print(
                            f"{row['layout']:<11} pages {row['page_size']:>2}:{row['decode_page_size']:<2} "
                            f"tp {row['tp']:>4} senders {row['senders']:>2} {'+'.join(row['mode']):<13} "
                            f"ranges {row['ranges_per_request']:>7} {row['bytes'] / 1e6:7.1f} MB "
                            f"{row['ms']:>8.1f} ms x1:1 {row['x_1to1']} (equal pages {row['x_equal_pages']}) "
                            f"aggregate {row['aggregate_gbps']:>5.2f} GB/s per decode rank "
                            f"{row['per_decode_rank_gbps']} host cpu {row['host_cpu_ms']} ms"
                            + (
                                f" | prepared ahead {row['ahead_ms']:.1f} ms x1:1 {row['x_1to1_ahead']}"
                                if "ahead_ms" in row
                                else ""
                            ),
                            flush=True,
                        )
    finally:
        for p in peers:
            p.close()
    if args.json:
        print(
            json.dumps(
                {
                    "preset": args.preset,
                    "device": args.device,
                    "transport": args.transport,
                    "scatter_workers": args.scatter_workers,
                    "staging_chunk_kib": args.staging_chunk_kib,
                    "mooncake_engines": args.mooncake_engines,
                    "cuda_ipc_blocks": args.cuda_ipc_blocks,
                    "gpus": torch.cuda.device_count(),
                    "mps_daemon": _mps_daemon(),
                    "host_cores": len(os.sched_getaffinity(0)),
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
