"""DisaggConnector: disagg's transfer layer as a vLLM KV connector (vLLM 0.32).

    --kv-transfer-config '{"kv_connector": "DisaggConnector",
                           "kv_connector_module_path": "disagg.vllm.connector",
                           "kv_role": "kv_producer",      # prefill; "kv_consumer" on decode;
                                                          # "kv_both": either, per request
                           "kv_connector_extra_config": {"bootstrap": "tcp://127.0.0.1:8998"}}'

vLLM builds it twice: in the scheduler (role SCHEDULER: disagg.vllm.scheduler) and in each
worker (role WORKER: disagg.vllm.worker); the scheduler's per-step metadata is the only thing
that passes between them. The workers' transfer figures go to vLLM's log and /metrics
(disagg.vllm.metrics). This module and metrics.py are the ones that import vLLM.
"""

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from disagg.vllm import stats
from disagg.vllm.groups import Group, Kind, KVGroups
from disagg.vllm.layout import layer_index
from disagg.vllm.metrics import DisaggPromMetrics, DisaggStats
from disagg.vllm.scheduler import DisaggScheduler, StepMeta
from disagg.vllm.states import GDNHeads, gdn_state
from kvpool.spec import LinearStateSpec

COMPLETED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class DisaggConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's sends, loads and releases, for every worker."""

    def __init__(self, step: StepMeta):
        self.step = step


class DisaggConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self._extra: dict[str, Any] = dict(cfg.kv_connector_extra_config or {})
        self._scheduler: DisaggScheduler | None = None
        self._worker = None
        kv = kv_groups(kv_cache_config, vllm_config.cache_config.block_size, vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = DisaggScheduler(
                kv.groups, cfg.is_kv_producer, cfg.is_kv_consumer, self._extra.get("bootstrap")
            )
        else:
            from disagg.vllm.worker import DisaggWorker  # the transfer layer: worker processes only

            self._worker = DisaggWorker.from_vllm(vllm_config, self._extra, kv)

    # ---- scheduler side -----------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        """A producer's request of a model with a state group is prefilled without its last
        prompt token (disagg.vllm.scheduler: the consumer computes it from the state)."""
        drop = self._scheduler.truncate(request)
        if drop and request.prompt_token_ids is not None:
            del request.prompt_token_ids[-drop:]
            del request._all_token_ids[-drop:]
            request.num_prompt_tokens -= drop
            request.max_tokens = 1

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return DisaggConnectorMetadata(self._scheduler.build_meta())

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.loaded(set(connector_output.finished_recving or ()))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self._scheduler.request_finished(request, block_ids, request.status in COMPLETED)

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.step(self._get_connector_metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are async (between steps): a request runs only once its KV has landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        """The producer sends a finished prompt's blocks from vLLM's cache once a consumer asks."""

    def wait_for_save(self) -> None:
        """Nothing is saved during the forward pass (see save_kv_layer)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As get_finished, and the failed loads' requests (several KV cache groups: vLLM takes
        failures per request there, block ids below for one group)."""
        sending, recving = self._worker.finished()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), self._worker.failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> DisaggStats | None:
        """The figures of the transfers get_transfer_results just reported (none: None)."""
        if self._worker is None:
            return None
        data = self._worker.figures()
        return None if stats.is_empty(data) else DisaggStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DisaggStats:
        """A copy of `data`: vLLM's log aggregates into what this returns, and its Prometheus
        logger reads the same step's dict after it."""
        return DisaggStats(data=stats.merge(stats.empty(), data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> DisaggPromMetrics:
        return DisaggPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


def kv_groups(kv_cache_config, block_size: int, vllm_config=None) -> KVGroups:
    """vLLM's KV cache groups as ours, the names of the state (Mamba/GDN) layers (and their
    geometry, read off vllm_config's checkpoint, where described: disagg.vllm.states) and of
    the sliding-window ones (and the longest window); one full group of `block_size` without a
    config. Raises ValueError naming a group we cannot move."""
    if kv_cache_config is None:
        return KVGroups((Group(Kind.FULL, block_size),), cpu_kernel=cpu_kernel(vllm_config))
    groups, windowed, window, states = [], set(), 0, {}
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append(Group(Kind.WINDOW, spec.block_size, -(-spec.sliding_window // spec.block_size) + 1))
            windowed.update(g.layer_names)
            window = max(window, spec.sliding_window)
        elif isinstance(spec, MambaSpec):
            groups.append(Group(Kind.STATE, spec.block_size, scratch_blocks=spec.num_speculative_blocks))
            states.update(dict.fromkeys(g.layer_names, spec))
        elif isinstance(spec, FullAttentionSpec) and getattr(spec, "sliding_window", None) is None:
            groups.append(Group(Kind.FULL, spec.block_size))
        else:
            raise ValueError(
                f"DisaggConnector: KV cache group {g.layer_names[:3]} of {type(spec).__name__} is "
                "not supported (full attention, sliding window and Mamba/GDN state are)"
            )
    state, refusal = _state(states, vllm_config) if states else (None, "")
    kernel = cpu_kernel(vllm_config)
    return KVGroups(tuple(groups), frozenset(states), frozenset(windowed), window, state, refusal, kernel)


def cpu_kernel(vllm_config) -> str:
    """The ISA of vLLM's CPU attention kernel for this model ("vec", "vec16", "amx", "neon",
    ...): each lays out a block's rows its own way (disagg.vllm.layout.CPU_KERNELS are the
    ones described); "" off CPU or without a config, "unknown" where vLLM does not say."""
    from vllm.platforms import current_platform

    if vllm_config is None or not current_platform.is_cpu():
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        return str(_get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype))
    except Exception:  # another vLLM: its CPU kernels are not known here
        return "unknown"


def _state(specs: dict, vllm_config) -> tuple[LinearStateSpec | None, str]:
    """The state layers' geometry in kvpool's terms (disagg.vllm.states), or None and why not,
    naming a layer."""
    name, spec = next(iter(specs.items()))
    hf = vllm_config.model_config.hf_text_config if vllm_config is not None else None
    if spec.mamba_type is not MambaAttentionBackendEnum.GDN_ATTN or not hasattr(hf, "linear_num_key_heads"):
        return None, f"state layer {name!r}: a {spec.mamba_type.name} state is not described as TP slices"
    if len({(s.shapes, s.dtypes) for s in specs.values()}) > 1:
        return None, f"state layer {name!r}: the state layers' shapes differ"
    heads = GDNHeads(
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim
    )
    try:
        return gdn_state(
            tuple(sorted(layer_index(n) for n in specs)),
            spec.shapes,
            tuple(str(d).removeprefix("torch.") for d in spec.dtypes),
            heads,
            vllm_config.parallel_config.tensor_parallel_size,
            dim_first=is_conv_state_dim_first(),
        ), ""
    except ValueError as exc:
        return None, f"state layer {name!r}: {exc}"
