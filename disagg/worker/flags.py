"""Flags shared by `disagg prefill` and `disagg decode`, and their frozen configs."""

import argparse
import json
import sys

from disagg.api.connections import HttpLimits
from disagg.process import add_process_flags
from disagg.control.auth import add_auth_flags, key_of
from disagg.control.deadlines import Deadlines
from disagg.worker.checks import byte_size, cuda_device, device_name, port, positive_int, power_of_two, seconds
from disagg.worker.pool_settings import PoolSettings
from disagg.engine import registry
from disagg.errors import ConfigError
from disagg.engine.model.families import FAMILIES
from kvpool.layout import Layout
from kvpool.presets import PRESETS
from transfer.config import Mode, TransferConfig
from transfer.faults import POINTS, FaultPlan
from transfer.transports import TRANSPORTS, TransportSettings, resolve

# A TP instance's senders or destinations each stage through slots of their own (issue 40):
# 16 slots of 16 MiB (256 MiB) cover TP 8 -> 1 and 1 -> 8 at two slots each.
STAGING_SLOTS = 16


def add_pool_flags(p: argparse.ArgumentParser) -> None:
    """The flags prefill and decode share (each role adds its own); every flag also reads
    DISAGG_<FLAG> and --config (disagg/config.py)."""
    g = p.add_argument_group("model and pool")
    g.add_argument("--preset", default="tiny-hybrid", choices=[*PRESETS, *FAMILIES], metavar="PRESET",
                   help="model geometry: one of `disagg presets`; tiny-model-* and model-* are model families "
                        "whose geometry comes from the model itself (" + ", ".join(FAMILIES) + ")")
    g.add_argument("--engine", default="auto", choices=registry.CHOICES,
                   help="what computes KV: model = transformers model code with seeded random weights "
                        "(tiny-model-*, model-* presets), standin = deterministic bytes (any preset, fast); "
                        "auto: model for those presets, else standin")
    g.add_argument("--page-size", type=power_of_two, default=None, help="tokens per page, a power of two "
                   "(default: the preset's)")
    cap = g.add_mutually_exclusive_group()
    cap.add_argument("--max-tokens", type=positive_int, default=None,
                     help="pool capacity in full-attention tokens (default 65536 unless --pool-bytes)")
    cap.add_argument("--pool-bytes", type=byte_size, default=None, metavar="SIZE",
                     help="pool capacity as a memory budget, e.g. 8GiB or 512MiB, split across components "
                          "(default: --max-tokens)")
    g.add_argument("--max-requests", type=positive_int, default=64,
                   help="request slots: requests held at once (each has one Mamba/GDN state and one AUX row)")
    g.add_argument("--layout", default="page_major", choices=[l.value for l in Layout],
                   help="buffer layout: page_major = one buffer per component, a page of every layer contiguous "
                        "(fewest transfer ranges); layer_major = one buffer per layer and part (as SGLang/vLLM)")
    g.add_argument("--device", default="auto", type=device_name, metavar="DEVICE",
                   help="where the pool lives: cpu, cuda, cuda:N, or auto (cuda where torch sees a GPU)")
    g.add_argument("--tp-size", type=positive_int, default=1,
                   help="tensor-parallel ranks of this instance: one worker process per rank, each holding its "
                        "share of the heads (prefill and decode may differ: the KV is resharded on the way)")
    g.add_argument("--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank (0 .. tp-size - 1)")
    g = p.add_argument_group("HTTP (/health, /ready, /metrics and the API)")
    g.add_argument("--http-host", default=None, help="address to serve on (default: --host; 0.0.0.0 for "
                   "Kubernetes probes)")
    g.add_argument("--http-port", type=port, default=0, help="port to serve on (0: any free port, printed when "
                   "ready)")
    add_http_limit_flags(g)
    g = p.add_argument_group("transfer")
    g.add_argument("--host", default="127.0.0.1", help="address to bind and advertise for control and transfer "
                   "(the pod IP on Kubernetes; another host's peers must reach it)")
    g.add_argument("--transport", default="auto", choices=["auto", *TRANSPORTS.names()],
                   help="how KV bytes move; auto: every transport this machine runs, the peers pick the first "
                        "both have (cuda-ipc for CUDA pools on one host, else mooncake)")
    g.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"], help="Mooncake's own protocol")
    g.add_argument("--rdma-devices", default="", metavar="NIC,...",
                   help="RDMA NICs for Mooncake, e.g. mlx5_0,mlx5_1 (empty: all)")
    g.add_argument("--cuda-ipc-blocks", type=positive_int, default=32,
                   help="thread blocks (of 512 threads) the cuda-ipc copy kernel takes: few, so it runs beside "
                        "compute")
    g.add_argument("--transfer-mode", default="auto", choices=[m.value for m in Mode],
                   help="direct = one write per contiguous run; staged = gather into staging slots, one write per "
                        "slot, scatter on decode (for many small runs); auto: chosen per request by a cost model")
    g.add_argument("--staging-slots", type=positive_int, default=STAGING_SLOTS,
                   help="staging slots (for staged transfers): decode lends every sender of a request one or "
                        "more at once (TP 8 -> 1: eight), prefill gathers each destination's chunks in its own "
                        "(TP 1 -> 8: eight sends at once)")
    g.add_argument("--staging-slot-mib", type=positive_int, default=16, help="size of one staging slot, MiB")
    g = p.add_argument_group("deadlines, liveness and admission")
    g.add_argument("--bootstrap-timeout", type=seconds, default=10.0,
                   help="seconds to introduce the two sides for a request (decode: lookup, registration, pool "
                        "space; prefill: decode's TransferRequest)")
    g.add_argument("--waiting-timeout", type=seconds, default=30.0,
                   help="seconds waiting for the input (prefill: its KV computed; decode: the transfer to start)")
    g.add_argument("--transfer-timeout", type=seconds, default=30.0, help="seconds for the transfer itself")
    g.add_argument("--dead-after", type=seconds, default=5.0,
                   help="seconds of silence from a peer after which its requests fail")
    g.add_argument("--queue-wait", type=seconds, default=5.0,
                   help="seconds a request may wait for pool space before a 503")
    g.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests waiting for pool space (more: 503 at once)")
    g.add_argument("--max-inflight", type=positive_int, default=256,
                   help="concurrent API requests (more: 503 at once)")
    add_auth_flags(p)
    add_process_flags(p, torch_threads=True)
    g = p.add_argument_group("fault injection (testing)")
    g.add_argument("--inject-faults", default="", metavar="POINT=RATE,...",
                   help="fail on purpose at these points with these probabilities; points: " + ", ".join(POINTS))
    g.add_argument("--fault-seed", type=int, default=None, help="seed for the injected faults (default: random)")


def add_http_limit_flags(g) -> None:
    g.add_argument("--http-receive-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="a request's headers and body must arrive within this, in total, from its first byte "
                        "(408 and the connection closed after)")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The HTTP server's limits: connections follow --max-inflight (with room for probes)."""
    return HttpLimits(max_inflight=args.max_inflight, receive_s=args.http_receive_timeout,
                      idle_s=max(args.http_receive_timeout, 5.0))


def resolve_device(device: str) -> str:
    """--device auto -> cuda where torch sees a GPU, else cpu (as the pool resolves it)."""
    if device != "auto":
        cuda_device(device)
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def pool_settings(args: argparse.Namespace) -> PoolSettings:
    if not 0 <= args.tp_rank < args.tp_size:
        raise ConfigError(f"--tp-rank {args.tp_rank} is not a rank of --tp-size {args.tp_size} (0 .. {args.tp_size - 1})")
    max_tokens = args.max_tokens if args.max_tokens or args.pool_bytes else 65536
    return PoolSettings(args.preset, args.page_size, max_tokens, args.pool_bytes, args.max_requests,
                        args.layout, args.device, args.tp_size, args.tp_rank)


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(mode=Mode(args.transfer_mode), staging_slots=args.staging_slots,
                          staging_slot_bytes=args.staging_slot_mib << 20,
                          faults=FaultPlan.parse(args.inject_faults, args.fault_seed))


def transports(args: argparse.Namespace) -> tuple[str, ...]:
    return resolve(args.transport, transport_settings(args))


def transport_settings(args: argparse.Namespace) -> TransportSettings:
    return TransportSettings(args.host, args.mooncake_protocol, args.rdma_devices, resolve_device(args.device),
                             args.cuda_ipc_blocks)


def deadlines(args: argparse.Namespace) -> Deadlines:
    return Deadlines(args.bootstrap_timeout, args.waiting_timeout, args.transfer_timeout)


def worker_settings(args: argparse.Namespace) -> dict:
    """The fields of worker.base.WorkerSettings both roles take from the shared flags."""
    return dict(pool=pool_settings(args), host=args.host, transports=transports(args),
                transport_settings=transport_settings(args), transfer=transfer_config(args),
                deadlines=deadlines(args), dead_after_s=args.dead_after, queue_wait_s=args.queue_wait,
                max_waiting=args.max_waiting, auth=key_of(args), engine=args.engine)


def http_url(args: argparse.Namespace, port: int) -> str:
    """The URL others reach our API at (the advertised host when bound to every address)."""
    host = args.http_host or args.host
    return f"http://{args.host if host == '0.0.0.0' else host}:{port}"


def announce(role: str, http: str, **more) -> None:
    """Once the process is ready: a line for a person on stderr ("decode ready on http://...")
    and one JSON line on stdout for launchers such as `disagg demo`."""
    extra = "".join(f", {k} {v}" for k, v in more.items() if isinstance(v, (str, int)) and k != "pool")
    pool = more.get("pool", {})
    if pool:
        extra += f", pool {pool['human']} on {pool['device']}"
    print(f"disagg {role} ready on {http}{extra}", file=sys.stderr, flush=True)
    print(json.dumps({"role": role, "http": http, **more}), flush=True)
