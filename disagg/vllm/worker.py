"""DisaggWorker: the worker side of DisaggConnector, one per vLLM worker (TP rank).

    from_vllm(vllm_config, extra)  settings only (kv_connector_extra_config: disagg.vllm.settings)
    register(kv_caches)            vLLM's KV tensors as an EnginePool (disagg.vllm.layout), exposed
                                   to our transports through a KVSender (producer) or KVReceiver
                                   (consumer); the control plane starts (disagg.vllm.producer /
                                   consumer: bootstrap, registration with the layout check,
                                   CURVE auth, deadlines, aborts, peer loss)
    step(meta)                     a scheduler step's Sends / Loads / Releases
    finished()                     (finished_sending, finished_recving) since the last call
    load_errors()                  the blocks of the loads finished() just reported failed
    failed_loads()                 their requests, for models of several KV cache groups
    close()

vLLM calls these from its own thread; a loop thread of ours owns the ZMQ sockets and the
request table. They meet in one place, the Handoff. Only disagg.vllm.connector imports vLLM:
from_vllm reads the config object's fields.
"""

import logging
import os
import time
from dataclasses import dataclass

import torch
import zmq

from disagg.control.auth import Gate
from disagg.control.layout import LayoutInfo, describe_model
from disagg.errors import ConfigError
from disagg.vllm.consumer import Consumer
from disagg.vllm.groups import Group, Kind
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


@dataclass(frozen=True)
class KVGroups:
    """vLLM's KV cache groups (disagg.vllm.groups) and which layers hold a state."""

    groups: tuple[Group, ...]
    state_layers: frozenset[str] = frozenset()


# whole blocks, straight into vLLM's cache: no staging (a minimal area, which the endpoint always has)
TRANSFER = TransferConfig(mode=Mode.DIRECT, staging_slots=1, staging_slot_bytes=4096)


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
        producer: bool,
        block_size: int,
        model_name: str,
        tp: tuple[int, int] = (1, 0),
        kv: KVGroups | None = None,
    ):
        if producer and not settings.bootstrap:
            raise ConfigError("a kv_producer needs kv_connector_extra_config.bootstrap (tcp://host:port)")
        self.settings, self.producer, self.block_size, self.model_name, self.tp, self.kv = (
            settings,
            producer,
            block_size,
            model_name,
            tp,
            kv or KVGroups((Group(Kind.FULL, block_size),)),
        )
        self.handoff = Handoff()
        self.endpoint = self.side = self.gate = self._ctx = None

    @staticmethod
    def from_vllm(vllm_config, extra: dict, groups: tuple[Group, ...], state_layers: frozenset[str]) -> "DisaggWorker":
        kv = vllm_config.kv_transfer_config
        if kv.is_kv_producer and kv.is_kv_consumer:
            raise ConfigError(
                "DisaggConnector: kv_role kv_both is not supported yet; run a kv_producer and a kv_consumer"
            )
        par = vllm_config.parallel_config
        tp_size = par.tensor_parallel_size
        name = os.path.basename(str(vllm_config.model_config.model).rstrip("/")) or "model"
        return DisaggWorker(
            ConnectorSettings.from_extra(extra),
            kv.is_kv_producer,
            vllm_config.cache_config.block_size,
            name,
            (tp_size, getattr(par, "rank", 0) % tp_size),
            KVGroups(groups, state_layers),
        )

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's tensors, expose them, start the control plane. Raises
        VllmLayoutError / ConfigError / a transport's error with one line; nothing is left open."""
        pool = engine_pool(kv_caches, self.block_size, self.model_name, *self.tp, self.kv.state_layers)
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
            self.gate = Gate(self._ctx, s.auth, f"vLLM {'producer' if self.producer else 'consumer'} worker")
            epoch = time.time_ns()
            self.side = (
                Producer(
                    s,
                    KVSender(self.endpoint),
                    layout,
                    self.gate,
                    self.handoff,
                    epoch,
                    tp=self.tp,
                    groups=self.kv.groups,
                )
                if self.producer
                else Consumer(
                    s, KVReceiver(self.endpoint), layout, self.gate, self.handoff, epoch, groups=self.kv.groups
                )
            )
        except BaseException:
            self.close(transports)
            raise
        log.info(
            "disagg %s: %d KV buffers of %d blocks (%s), transports %s",
            "producer" if self.producer else "consumer",
            len(self.endpoint.buffers),
            pool.num_blocks,
            pool.config.device,
            [t.kind for t in transports],
        )

    def step(self, meta: StepMeta) -> None:
        if meta.sends or meta.loads or meta.releases:
            self.handoff.post(meta)
            if self.side is not None:
                self.side.wake()  # its loop takes the step now, not after its poll timeout

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        return self.handoff.finished()

    def load_errors(self) -> set[int]:
        """The failed loads' blocks (one KV cache group: vLLM recomputes from the first bad
        block); none with several groups, whose failures go by request (failed_loads)."""
        return self.handoff.load_errors() if len(self.kv.groups) == 1 else set()

    def failed_loads(self) -> set[str]:
        """The failed loads' requests, with several KV cache groups (vLLM refuses block-level
        failures for those: its block ids are not unique across groups' layers)."""
        return self.handoff.failed_loads() if len(self.kv.groups) > 1 else set()

    def close(self, transports=None) -> None:
        side, self.side = self.side, None
        if side is not None:
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
