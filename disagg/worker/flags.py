"""Flags shared by `disagg prefill` and `disagg decode`, and their frozen configs."""

import argparse
import json
import sys

from disagg.api.connections import HttpLimits
from disagg.process import add_process_flags
from disagg.control.auth import add_auth_flags, key_of
from disagg.control.deadlines import Deadlines
from disagg.checks import (
    byte_size,
    cuda_device,
    device_name,
    non_negative_int,
    port,
    positive_int,
    power_of_two,
    seconds,
    share_above_zero,
)
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
    _model_and_pool_flags(p.add_argument_group("model and pool"))
    _http_flags(p.add_argument_group("HTTP (/health, /ready, /metrics and the API)"))
    _transfer_flags(p.add_argument_group("transfer"))
    _deadline_flags(p.add_argument_group("deadlines, liveness and admission"))
    add_auth_flags(p)
    add_process_flags(p, torch_threads=True)
    g = p.add_argument_group("fault injection (testing)")
    g.add_argument(
        "--inject-faults",
        default="",
        metavar="POINT=RATE,...",
        help="fail on purpose at these points with these probabilities; points: " + ", ".join(POINTS),
    )
    g.add_argument("--fault-seed", type=int, default=None, help="seed for the injected faults (default: random)")


def _model_and_pool_flags(g) -> None:
    g.add_argument(
        "--preset",
        default="tiny-hybrid",
        choices=[*PRESETS, *FAMILIES],
        metavar="PRESET",
        help="model geometry: one of `disagg presets`; tiny-model-* and model-* are model families "
        "whose geometry comes from the model itself (" + ", ".join(FAMILIES) + ")",
    )
    g.add_argument(
        "--engine",
        default="auto",
        choices=registry.CHOICES,
        help="what computes KV: model = transformers model code with seeded random weights "
        "(tiny-model-*, model-* presets), standin = deterministic bytes (any preset, fast); "
        "auto: model for those presets, else standin",
    )
    add_model_flags(g)
    g.add_argument(
        "--page-size", type=power_of_two, default=None, help="tokens per page, a power of two (default: the preset's)"
    )
    cap = g.add_mutually_exclusive_group()
    cap.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="pool capacity in full-attention tokens (default 65536 unless --pool-bytes)",
    )
    cap.add_argument(
        "--pool-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="pool capacity as a memory budget, e.g. 8GiB or 512MiB, split across components (default: --max-tokens)",
    )
    g.add_argument(
        "--max-requests",
        type=positive_int,
        default=64,
        help="request slots: requests held at once (each has one Mamba/GDN state and one AUX row)",
    )
    g.add_argument(
        "--layout",
        default="page_major",
        choices=[l.value for l in Layout],
        help="buffer layout: page_major = one buffer per component, a page of every layer contiguous "
        "(fewest transfer ranges); layer_major = one buffer per layer and part (as SGLang/vLLM)",
    )
    g.add_argument(
        "--device",
        default="auto",
        type=device_name,
        metavar="DEVICE",
        help="where the pool lives: cpu, cuda, cuda:N, or auto (cuda where torch sees a GPU)",
    )
    g.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks of this instance: one worker process per rank, each holding its "
        "share of the heads (prefill and decode may differ: the KV is resharded on the way)",
    )
    g.add_argument("--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank (0 .. tp-size - 1)")
    g.add_argument(
        "--swa-share",
        type=share_above_zero,
        default=None,
        metavar="SHARE",
        help="sliding-window pages as a share of full-attention pages (default: 1 on prefill, which "
        "keeps every SWA page of a prompt while computing it; 0.5 on decode, which keeps the "
        "window only)",
    )


def _http_flags(g) -> None:
    g.add_argument(
        "--http-host", default=None, help="address to serve on (default: --host; 0.0.0.0 for Kubernetes probes)"
    )
    g.add_argument("--http-port", type=port, default=0, help="port to serve on (0: any free port, printed when ready)")
    add_http_limit_flags(g)


def _transfer_flags(g) -> None:
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind and advertise for control and transfer "
        "(the pod IP on Kubernetes; another host's peers must reach it)",
    )
    g.add_argument(
        "--transport",
        default="auto",
        choices=TRANSPORTS.choices(),
        help="how KV bytes move; auto: every transport this machine runs, the peers pick the first "
        "both have (cuda-ipc for CUDA pools on one host, else mooncake)",
    )
    TRANSPORTS.add_flags(g)  # each transport's own (--mooncake-protocol, --cuda-ipc-blocks, ...)
    g.add_argument(
        "--transfer-mode",
        default="auto",
        choices=[m.value for m in Mode],
        help="direct = one write per contiguous run; staged = gather into staging slots, one write per "
        "slot, scatter on decode (for many small runs); gathered = gather into an image of decode's pages, "
        "one write per run of them (where one prefill rank covers decode's whole rows, host pools); auto: "
        "chosen per request by a cost model",
    )
    g.add_argument(
        "--staging-slots",
        type=positive_int,
        default=STAGING_SLOTS,
        help="staging slots (for staged transfers): decode lends every sender of a request one or "
        "more at once (TP 8 -> 1: eight), prefill gathers each destination's chunks in its own "
        "(TP 1 -> 8: eight sends at once)",
    )
    g.add_argument("--staging-slot-mib", type=positive_int, default=16, help="size of one staging slot, MiB")
    g.add_argument(
        "--staging-chunk-kib",
        type=non_negative_int,
        default=0,
        help="prefill: bytes of one staged chunk, KiB (0: a whole slot); smaller chunks overlap gathering, "
        "writing and decode's scatter, each costs a notice, an ack and a write",
    )


def _deadline_flags(g) -> None:
    g.add_argument(
        "--bootstrap-timeout",
        type=seconds,
        default=10.0,
        help="seconds to introduce the two sides for a request (decode: lookup, registration, pool "
        "space; prefill: decode's TransferRequest)",
    )
    g.add_argument(
        "--waiting-timeout",
        type=seconds,
        default=30.0,
        help="seconds waiting for the input (prefill: its KV computed; decode: the transfer to start)",
    )
    g.add_argument("--transfer-timeout", type=seconds, default=30.0, help="seconds for the transfer itself")
    g.add_argument(
        "--dead-after", type=seconds, default=5.0, help="seconds of silence from a peer after which its requests fail"
    )
    g.add_argument(
        "--queue-wait", type=seconds, default=5.0, help="seconds a request may wait for pool space before a 503"
    )
    g.add_argument(
        "--max-waiting", type=positive_int, default=64, help="requests waiting for pool space (more: 503 at once)"
    )
    g.add_argument("--max-inflight", type=positive_int, default=256, help="concurrent API requests (more: 503 at once)")


def add_model_flags(g) -> None:
    """Where the model engine's model comes from, beside --preset (disagg.engine.model.source)."""
    g.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local HuggingFace model directory (config.json + *.safetensors), loaded with transformers "
        "offline; the pool geometry is read off it (implies the model engine; both sides must hold "
        "the same model: config and weights are checked at registration)",
    )
    g.add_argument(
        "--model-type",
        default=None,
        metavar="TYPE",
        help="instead of --model: seeded random weights of this transformers model_type (bamba, "
        "falcon_h1, ...) with --model-config",
    )
    g.add_argument(
        "--model-config",
        default=None,
        metavar="JSON",
        help="the --model-type's config fields as a JSON object, e.g. '{\"num_hidden_layers\": 4}'",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype of --model / --model-type (auto: the config's; float32 for --model-type)",
    )
    g.add_argument(
        "--prefill-chunk",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="model engine: tokens per prefill pass, at positions that are multiples of N, so a prompt's "
        "whole chunks are the same bits in any longer prompt (the prefix caches reuse them; 0: one pass, "
        "no reuse; default: the family's, 8 for tiny-model-*, 0 for --model / --model-type); prefill and "
        "decode must run the same (checked at registration)",
    )


def model_source(args: argparse.Namespace, page_size: int | None = None):
    """The ModelSource of --model / --model-type (None: the preset's own), refused in one line."""
    if args.model is None and args.model_type is None:
        if args.model_config is not None:
            raise ConfigError("--model-config goes with --model-type")
        return None
    from disagg.engine.model.source import ModelSource

    return ModelSource(args.model, args.model_type, args.model_config, args.dtype, page_size or 16)


def add_http_limit_flags(g) -> None:
    g.add_argument(
        "--http-receive-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="a request's headers and body must arrive within this, in total, from its first byte "
        "(408 and the connection closed after)",
    )


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The HTTP server's limits: connections follow --max-inflight (with room for probes)."""
    return HttpLimits(
        max_inflight=args.max_inflight, receive_s=args.http_receive_timeout, idle_s=max(args.http_receive_timeout, 5.0)
    )


def resolve_device(device: str) -> str:
    """--device auto -> cuda where torch sees a GPU, else cpu (as the pool resolves it)."""
    if device != "auto":
        cuda_device(device)
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pool_settings(args: argparse.Namespace) -> PoolSettings:
    if not 0 <= args.tp_rank < args.tp_size:
        raise ConfigError(
            f"--tp-rank {args.tp_rank} is not a rank of --tp-size {args.tp_size} (0 .. {args.tp_size - 1})"
        )
    max_tokens = args.max_tokens if args.max_tokens or args.pool_bytes else 65536
    source = model_source(args)
    return PoolSettings(
        source.name if source is not None else args.preset,
        args.page_size,
        max_tokens,
        args.pool_bytes,
        args.max_requests,
        args.layout,
        args.device,
        args.tp_size,
        args.tp_rank,
        args.swa_share,
    )


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        mode=Mode(args.transfer_mode),
        staging_slots=args.staging_slots,
        staging_slot_bytes=args.staging_slot_mib << 20,
        staging_chunk_bytes=args.staging_chunk_kib << 10,
        faults=FaultPlan.parse(args.inject_faults, args.fault_seed),
    )


def transports(args: argparse.Namespace) -> tuple[str, ...]:
    return resolve(args.transport, transport_settings(args))


def transport_settings(args: argparse.Namespace) -> TransportSettings:
    return TransportSettings(args.host, resolve_device(args.device), TRANSPORTS.own_settings(args))


def deadlines(args: argparse.Namespace) -> Deadlines:
    return Deadlines(args.bootstrap_timeout, args.waiting_timeout, args.transfer_timeout)


def worker_settings(args: argparse.Namespace) -> dict:
    """The fields of worker.base.WorkerSettings both roles take from the shared flags."""
    return dict(
        pool=pool_settings(args),
        host=args.host,
        transports=transports(args),
        transport_settings=transport_settings(args),
        transfer=transfer_config(args),
        deadlines=deadlines(args),
        dead_after_s=args.dead_after,
        queue_wait_s=args.queue_wait,
        max_waiting=args.max_waiting,
        auth=key_of(args),
        engine=args.engine,
        model_source=model_source(args, args.page_size),
        prefill_chunk=args.prefill_chunk,
    )


def http_url(args: argparse.Namespace, port: int) -> str:
    """The URL others reach our API at (the advertised host when bound to every address)."""
    host = args.http_host or args.host
    return f"http://{args.host if host == '0.0.0.0' else host}:{port}"


def announce(role: str, http: str, not_ready: str | None = None, **more) -> None:
    """Once the process serves: a line for a person on stderr ("decode ready on http://...",
    or, for a router whose pairs are all down, that it serves but is not ready, and why) and
    one JSON line on stdout for launchers such as `disagg demo`."""
    extra = "".join(f", {k} {v}" for k, v in more.items() if isinstance(v, (str, int)) and k != "pool")
    pool = more.get("pool", {})
    if pool:
        extra += f", pool {pool['human']} on {pool['device']}"
    state = "ready" if not_ready is None else "serving (not ready: " + not_ready + ")"
    print(f"disagg {role} {state} on {http}{extra}", file=sys.stderr, flush=True)
    if not_ready is not None:
        more["ready"] = False
    print(json.dumps({"role": role, "http": http, **more}), flush=True)
