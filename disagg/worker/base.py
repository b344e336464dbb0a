"""What prefill and decode workers share: settings, the pool and its admission, the transfer
endpoint over the configured transports, the layout they advertise, the model engine, the
ZMQ context and the stop flag.

    Worker(settings, model)    (the role builds its KVSender or KVReceiver on .endpoint)
      .pool       HybridPool                 .admission  bounded wait for pool space
      .endpoint   the pool exposed to the transports (region i = buffer i, then staging)
      .layout     LayoutInfo: page size, layout, buffers (what the other side checks)
      .model      the model engine (--engine; its geometry, if it has one, shapes the pool)
      .epoch      new on every start: a restarted worker is a new peer
      .gate       who may talk to its ZMQ sockets (control/auth.py)
      .requests   the role's RequestTable (set by the subclass): abort() goes through it
      .load       the requests it holds, queued and running (its /health's `load`, for the routers)
"""

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import zmq

from disagg import __version__
from disagg.control.admission import Admission
from disagg.control.auth import AuthKey, Gate
from disagg.control.layout import LayoutInfo, describe_model
from disagg.control.load import encode_load
from disagg.control.deadlines import Deadlines
from disagg.engine import registry
from disagg.engine.base import ModelEngine
from disagg.engine.model.source import ModelSource
from disagg.worker.load import LoadMeter
from disagg.worker.pool_settings import PoolSettings, memory
from disagg.errors import BadRequest, ConfigError
from kvpool import HybridPool
from kvpool.errors import SpecError
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.transports import TransportSettings, create

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    pool: PoolSettings = PoolSettings()
    host: str = "127.0.0.1"  # bound and advertised (control sockets)
    transports: tuple[str, ...] = ("mooncake",)  # decode offers them in this order; prefill picks
    transport_settings: TransportSettings = TransportSettings()
    transfer: TransferConfig = field(default_factory=TransferConfig)
    deadlines: Deadlines = field(default_factory=Deadlines)
    dead_after_s: float = 5.0  # a peer silent this long fails its requests
    queue_wait_s: float = 5.0  # longest wait for pool space before refusing
    max_waiting: int = 64  # requests waiting for pool space; more are refused at once
    auth: AuthKey = AuthKey()  # the deployment's key (none: insecure, logged loudly)
    engine: str = "auto"  # the model engine (disagg.engine.registry)
    simulate_layer_ms: float = 0.0  # stand-in engine: simulated compute per layer in prefill
    model_source: ModelSource | None = None  # --model / --model-type (None: the preset's own model)
    prefill_chunk: int | None = None  # model engine: tokens per prefill pass (None: the family's)


class Worker:
    def __init__(self, settings: WorkerSettings, model: ModelEngine | None, swa_window_only: bool):
        self.settings = settings
        self.model = model or registry.create(
            settings.engine,
            settings.pool.preset,
            settings.pool.resolved_device(),
            settings.simulate_layer_ms,
            settings.model_source,
            prefill_chunk=settings.prefill_chunk,
        )
        try:
            pool_config = settings.pool.pool_config(self.model.spec, swa_window_only)
        except SpecError as exc:  # a pool the flags describe cannot exist: one line, not a traceback
            raise ConfigError(
                f"{exc} (pool flags: --preset {settings.pool.preset}, --page-size, "
                f"--max-tokens or --pool-bytes, --max-requests, --tp-size)"
            ) from None
        self.pool_summary = memory(pool_config, settings.transfer.staging_slots * settings.transfer.staging_slot_bytes)
        log.info("pool %s: %s", settings.pool.preset, self.pool_summary["line"])
        self.pool = HybridPool(pool_config)
        self.admission = Admission(
            partial(self.pool.shortfall, swa_window_only=swa_window_only), settings.max_waiting, settings.queue_wait_s
        )
        self.endpoint = PoolEndpoint(
            create(settings.transports, settings.transport_settings), self.pool, settings.transfer
        )
        self.faults = self.endpoint.faults
        self.load = LoadMeter()
        self.epoch = time.time_ns()
        self.layout = LayoutInfo(
            self.pool.page_size,
            self.pool.config.layout.value,
            self.endpoint.buffers,
            describe_model(self.pool.config.model, self.pool.config.tp_size, getattr(self.model, "identity", None)),
        )
        self._ctx = zmq.Context()
        self.gate = Gate(self._ctx, settings.auth, type(self).__name__)
        self._stop = threading.Event()
        self.ready = False

    def check_tokens(self, token_ids) -> np.ndarray:
        """int64 [n] of a prompt the engine can run; BadRequest (nothing changed) otherwise."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        vocab = self.model.vocab_size
        if vocab is not None and len(tokens) and int(tokens.max()) >= vocab:
            raise BadRequest(
                f"token id {int(tokens.max())} is outside the model's vocabulary of {vocab} "
                f"(engine {self.model.name}, preset {self.settings.pool.preset})"
            )
        return tokens

    def threads(self) -> dict[str, bool]:
        """Threads the process cannot serve without -> alive (the role adds its own)."""
        return self.gate.threads()

    def available(self) -> dict[str, int]:
        """What a new request can take of the pool (decode counts its prefix cache's unused
        pages too: they are evicted for it)."""
        return self.pool.available()

    def health(self) -> dict:
        """/health: unhealthy (503, so an orchestrator restarts it) as soon as one of those died,
        rather than serving half-alive; with what a person checking a process wants to see."""
        dead = sorted(name for name, alive in self.threads().items() if not alive)
        return {
            "status": "unhealthy" if dead else "ok",
            **({"dead_threads": dead} if dead else {}),
            "role": type(self).__name__.removesuffix("Server").lower(),
            "version": __version__,
            "epoch": self.epoch,
            "preset": self.settings.pool.preset,
            "engine": self.model.name,
            "vocab_size": self.model.vocab_size,
            "device": str(self.pool.config.device),
            "transports": [t.kind for t in self.endpoint.transports],
            "auth": "curve" if self.gate.key.secure else "insecure",
            "available": self.available(),
            "load": encode_load(self.load.now()),
        }  # (the router's KV-aware choice weighs both)

    def abort(self, room: int, reason: str) -> dict:
        """Abort a room (router, client or operator): it fails now and the peer hears it; its
        pages come back once nothing writes into them. An unknown room is remembered as aborted,
        so a request for it that arrives later fails at once."""
        r = self.requests.get(room)
        if r is None:
            self.requests.abort(room, f"aborted: {reason}")
            return {"room": room, "aborted": False, "known": False}
        return {"room": room, "aborted": self.requests.fail(r, f"aborted: {reason}"), "known": True}

    def close(self) -> None:
        """After the subclass stopped its threads and closed its sockets."""
        self.endpoint.close()
        for t in self.endpoint.transports:
            t.close()
        self.gate.close()
        self._ctx.term()
