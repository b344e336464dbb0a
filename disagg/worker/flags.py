"""Flags shared by `disagg prefill` and `disagg decode`, and their frozen configs."""

import argparse
import json
import os

from disagg.control.auth import add_auth_flags, key_of
from disagg.control.deadlines import Deadlines
from disagg.worker.checks import cuda_device, positive_int, power_of_two
from disagg.worker.pool_settings import PoolSettings
from disagg.engine import registry
from disagg.engine.model.families import FAMILIES
from kvpool.layout import Layout
from kvpool.presets import PRESETS
from transfer.config import Mode, TransferConfig
from transfer.faults import POINTS, FaultPlan
from transfer.transports import TRANSPORTS, TransportSettings, resolve


def _env(name: str, default):
    return os.environ.get(name, default)


def add_pool_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pool")
    g.add_argument("--preset", default=_env("DISAGG_PRESET", "tiny-hybrid"), choices=[*PRESETS, *FAMILIES],
                   help="model geometry (env DISAGG_PRESET); tiny-model-* and model-* are model families whose "
                        "geometry comes from the model itself")
    g.add_argument("--engine", default=_env("DISAGG_ENGINE", "auto"), choices=registry.CHOICES,
                   help="what computes KV (env DISAGG_ENGINE): model = transformers model code with seeded "
                        "random weights (tiny-model-*, model-* presets), standin = deterministic bytes (any preset, "
                        "fast); auto: model for those presets, else standin")
    g.add_argument("--page-size", type=power_of_two, default=None, help="tokens per page, a power of two "
                   "(default: the preset's)")
    cap = g.add_mutually_exclusive_group()
    cap.add_argument("--max-tokens", type=positive_int, default=None, help="pool capacity in full-attention tokens")
    cap.add_argument("--pool-bytes", type=positive_int, default=None, help="pool capacity as a byte budget")
    g.add_argument("--max-requests", type=positive_int, default=64, help="request slots (Mamba state, AUX rows)")
    g.add_argument("--layout", default="page_major", choices=[l.value for l in Layout])
    g.add_argument("--device", default=_env("DISAGG_DEVICE", "auto"), help="cpu, cuda, cuda:N or auto")
    g = p.add_argument_group("transfer")
    g.add_argument("--host", default=_env("DISAGG_HOST", "127.0.0.1"), help="address to bind and advertise "
                   "(env DISAGG_HOST; the pod IP on Kubernetes)")
    g.add_argument("--http-host", default=_env("DISAGG_HTTP_HOST", None),
                   help="address for /health, /ready, /metrics and the API (env DISAGG_HTTP_HOST; default "
                        "--host; 0.0.0.0 for Kubernetes probes)")
    g.add_argument("--http-port", type=int, default=int(_env("DISAGG_HTTP_PORT", "0")), help="0: any free port")
    g.add_argument("--transport", default=_env("DISAGG_TRANSPORT", "auto"), choices=["auto", *TRANSPORTS.names()],
                   help="how KV bytes move (env DISAGG_TRANSPORT); auto: every transport this machine runs, "
                        "the peers pick the first both have")
    g.add_argument("--mooncake-protocol", default=_env("DISAGG_MOONCAKE_PROTOCOL", "tcp"), choices=["tcp", "rdma"],
                   help="Mooncake's own protocol (env DISAGG_MOONCAKE_PROTOCOL)")
    g.add_argument("--cuda-ipc-blocks", type=int, default=32,
                   help="thread blocks (of 512 threads) the cuda-ipc copy kernel takes: few, so it runs beside "
                        "compute")
    g.add_argument("--rdma-devices", default=_env("DISAGG_RDMA_DEVICES", ""),
                   help="comma-separated RDMA NICs, e.g. mlx5_0,mlx5_1 (env DISAGG_RDMA_DEVICES; empty: all)")
    g.add_argument("--transfer-mode", default="auto", choices=[m.value for m in Mode])
    g.add_argument("--staging-slots", type=int, default=4)
    g.add_argument("--staging-slot-mib", type=int, default=16)
    g = p.add_argument_group("deadlines and admission")
    g.add_argument("--bootstrap-timeout", type=float, default=10.0,
                   help="seconds to introduce the two sides for a request (decode: lookup, registration, pool "
                        "space; prefill: decode's TransferRequest)")
    g.add_argument("--waiting-timeout", type=float, default=30.0,
                   help="seconds waiting for the input (prefill: its KV computed; decode: the transfer to start)")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds for the transfer itself")
    g.add_argument("--queue-wait", type=float, default=5.0,
                   help="seconds a request may wait for pool space before a 503")
    g.add_argument("--max-waiting", type=int, default=64, help="requests waiting for pool space (more: 503 at once)")
    g.add_argument("--max-inflight", type=int, default=256, help="concurrent API requests (more: 503 at once)")
    add_auth_flags(p)
    g = p.add_argument_group("fault injection (testing)")
    g.add_argument("--inject-faults", default=_env("DISAGG_INJECT_FAULTS", ""), metavar="POINT=RATE,...",
                   help="fail on purpose at these points with these probabilities (env DISAGG_INJECT_FAULTS); "
                        "points: " + ", ".join(POINTS))
    g.add_argument("--fault-seed", type=int, default=None, help="seed for the injected faults")
    g.add_argument("--dead-after", type=float, default=5.0,
                   help="seconds of silence from a peer after which its requests fail")
    g.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (1 leaves cores to the transport's own threads)")


def resolve_device(device: str) -> str:
    """--device auto -> cuda where torch sees a GPU, else cpu (as the pool resolves it)."""
    if device != "auto":
        cuda_device(device)
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def pool_settings(args: argparse.Namespace) -> PoolSettings:
    max_tokens = args.max_tokens if args.max_tokens or args.pool_bytes else 65536
    return PoolSettings(args.preset, args.page_size, max_tokens, args.pool_bytes, args.max_requests,
                        args.layout, args.device)


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


def announce(**endpoints) -> None:
    """One JSON line on stdout once the process is ready (for launchers such as `disagg demo`)."""
    print(json.dumps(endpoints), flush=True)
