"""DisaggWorker: the worker side of DisaggConnector, one per vLLM worker (TP rank).

    from_vllm(vllm_config, extra)  settings only (kv_connector_extra_config: disagg.vllm.settings)
    register(kv_caches)            vLLM's KV tensors as an EnginePool (disagg.vllm.layout), exposed
                                   to our transports through a KVSender (producer) and/or a
                                   KVReceiver (consumer); the control plane starts (disagg.vllm.producer /
                                   consumer: bootstrap, registration with the layout check,
                                   CURVE auth, deadlines, aborts, peer loss)
    step(meta)                     a scheduler step's Sends / Loads / Releases
    finished()                     (finished_sending, finished_recving) since the last call
    load_errors()                  the blocks of the loads finished() just reported failed
    failed_loads()                 their requests, for models of several KV cache groups
    figures()                      how the transfers finished() reported went (disagg.vllm.stats)
    close()

vLLM calls these from its own thread; a loop thread of ours owns the ZMQ sockets and the
request table. They meet in one place, the Handoff. Only disagg.vllm.connector imports vLLM:
from_vllm reads the config object's fields.

kv_role kv_both runs a Producer and a Consumer over one endpoint (the same memory, transports
and CURVE gate), each with its own loop and Handoff: a request is sent or loaded as its
kv_transfer_params say (the scheduler's Sends go to the producer, its Loads and Releases to
the consumer), so one server can be the prefill of one request and the decode of the next.
"""

import enum
import logging
import os
import time

import torch
import zmq

from disagg.control.auth import Gate
from disagg.control.layout import LayoutInfo, describe_model
from disagg.errors import ConfigError
from disagg.vllm import stats
from disagg.vllm.consumer import Consumer
from disagg.vllm.groups import Group, Kind, KVGroups
from disagg.vllm.handoff import Handoff
from disagg.vllm.layout import engine_pool
from disagg.vllm.producer import Producer
from disagg.vllm.scheduler import StepMeta
from disagg.vllm.settings import ConnectorSettings
from transfer.config import Mode, TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.transports import TransportSettings, create, resolve
from transfer.transports.mooncake import MooncakeSettings

log = logging.getLogger(__name__)


# straight into vLLM's cache (whole blocks, or by token for another block or TP size): no staging
# (a minimal area, which the endpoint always has)
TRANSFER = TransferConfig(mode=Mode.DIRECT, staging_slots=1, staging_slot_bytes=4096)


class Role(enum.Enum):
    """vLLM's kv_role."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        return self is not Role.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not Role.PRODUCER


def transport_names(ts: TransportSettings, cma: bool) -> tuple[str, ...]:
    """`auto`'s transports, and before them on CPU pools (cma) the one that writes a peer on
    this host directly: loopback TCP moved 32 MiB in 31-69 ms on a 2-vCPU VM where
    process_vm_writev took 6 ms (transfer/transports/cma.py). The receiver offers them in this
    order; a writer takes the first it reaches, so a peer elsewhere gets Mooncake."""
    names = resolve("auto", ts)
    return ("cma", *names) if cma and ts.device == "cpu" else names


class DisaggWorker:
    def __init__(
        self,
        settings: ConnectorSettings,
        role: Role,
        block_size: int,
        model_name: str,
        tp: tuple[int, int] = (1, 0),
        kv: KVGroups | None = None,
    ):
        if role.produces and not settings.bootstrap:
            raise ConfigError(f"a {role.value} needs kv_connector_extra_config.bootstrap (tcp://host:port)")
        self.settings, self.role, self.block_size, self.model_name, self.tp, self.kv = (
            settings,
            role,
            block_size,
            model_name,
            tp,
            kv or KVGroups((Group(Kind.FULL, block_size),)),
        )
        # the producer's and the consumer's (kv_both: both; each loop takes only its own)
        self.sending = Handoff() if role.produces else None
        self.loading = Handoff() if role.consumes else None
        self.sides: list[Producer | Consumer] = []
        self.endpoint = self.gate = self._ctx = None

    @staticmethod
    def from_vllm(vllm_config, extra: dict, kv: KVGroups) -> "DisaggWorker":
        role = vllm_config.kv_transfer_config.kv_role
        par = vllm_config.parallel_config
        tp_size = par.tensor_parallel_size
        name = os.path.basename(str(vllm_config.model_config.model).rstrip("/")) or "model"
        return DisaggWorker(
            ConnectorSettings.from_extra(extra),
            Role(role),
            vllm_config.cache_config.block_size,
            name,
            (tp_size, getattr(par, "rank", 0) % tp_size),
            kv,
        )

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's tensors, expose them, start the control plane. Raises
        VllmLayoutError / ConfigError / a transport's error with one line; nothing is left open."""
        kv = self.kv
        pool = engine_pool(
            kv_caches,
            self.block_size,
            self.model_name,
            *self.tp,
            kv.state_layers,
            window_layers=kv.window_layers,
            window=kv.window,
            state=kv.state,
            state_refusal=kv.state_refusal,
            cpu_kernel=kv.cpu_kernel,
        )
        s = self.settings
        ts = TransportSettings(s.host, str(pool.config.device), (MooncakeSettings(s.mooncake_protocol),))
        transports = create(transport_names(ts, s.cma), ts)
        try:
            self.endpoint = PoolEndpoint(transports, pool, s.transfer_config(TRANSFER))
            layout = LayoutInfo(
                pool.page_size,
                pool.config.layout.value,
                self.endpoint.buffers,
                describe_model(pool.config.model, self.tp[0]),
            )
            self._ctx = zmq.Context()
            self.gate = Gate(self._ctx, s.auth, f"vLLM {self.role.value} worker")
            self._start_sides(layout, time.time_ns())
        except BaseException:
            self.close(transports)
            raise
        log.info(
            "disagg %s: %d KV buffers of %d blocks (%s), transports %s",
            self.role.value,
            len(self.endpoint.buffers),
            pool.num_blocks,
            pool.config.device,
            [t.kind for t in transports],
        )

    def _start_sides(self, layout: LayoutInfo, epoch: int) -> None:
        """The producer and/or the consumer, over our one endpoint (each in self.sides as soon
        as it runs: close() stops what started if the next one cannot)."""
        s, groups = self.settings, self.kv.groups
        if self.sending is not None:
            sender = KVSender(self.endpoint)
            self.sides.append(Producer(s, sender, layout, self.gate, self.sending, epoch, tp=self.tp, groups=groups))
        if self.loading is not None:
            receiver = KVReceiver(self.endpoint)
            self.sides.append(Consumer(s, receiver, layout, self.gate, self.loading, epoch, groups=groups))

    def step(self, meta: StepMeta) -> None:
        """A scheduler step: its Sends to the producer, its Loads and Releases to the consumer."""
        for side, handoff, mine in (
            (Producer, self.sending, meta.sends),
            (Consumer, self.loading, meta.loads or meta.releases),
        ):
            if handoff is not None and mine:
                handoff.post(meta)
                for running in self.sides:
                    if isinstance(running, side):
                        running.wake()  # its loop takes the step now, not after its poll timeout

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending = self.sending.finished()[0] if self.sending is not None else None
        recving = self.loading.finished()[1] if self.loading is not None else None
        return sending, recving

    def load_errors(self) -> set[int]:
        """The failed loads' blocks (one KV cache group: vLLM recomputes from the first bad
        block); none with several groups, whose failures go by request (failed_loads)."""
        return self.loading.load_errors() if self.loading is not None and len(self.kv.groups) == 1 else set()

    def failed_loads(self) -> set[str]:
        """The failed loads' requests, with several KV cache groups (vLLM refuses block-level
        failures for those: its block ids are not unique across groups' layers)."""
        return self.loading.failed_loads() if self.loading is not None and len(self.kv.groups) > 1 else set()

    def figures(self) -> dict:
        """The figures of the sends and loads finished() has reported since the last call."""
        out = stats.empty()
        for handoff in (self.sending, self.loading):
            if handoff is not None:
                stats.merge(out, handoff.figures())
        return out

    def close(self, transports=None) -> None:
        sides, self.sides = self.sides, []
        for side in sides:
            side.close()
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.close()
            transports = endpoint.transports
        for t in transports or ():
            t.close()
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:  # closes any socket a side that failed half-built left open (term would wait on it)
            ctx.destroy(linger=0)
