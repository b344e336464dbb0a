"""DisaggConnector's figures in vLLM's stats machinery (vLLM 0.32): what each worker's
get_kv_connector_stats hands over (disagg.vllm.stats data), added up across workers and steps,
logged every interval ("KV Transfer metrics: loads=1, load ms avg=..., load MB=...") and
exported on the server's /metrics:

    vllm:disagg_kv_loads_total, vllm:disagg_kv_loaded_bytes_total,    consumer (decode)
    vllm:disagg_kv_load_failures_total, vllm:disagg_kv_load_seconds (histogram)
    vllm:disagg_kv_sends_total, vllm:disagg_kv_sent_bytes_total,      producer (prefill)
    vllm:disagg_kv_send_failures_total, vllm:disagg_kv_send_seconds (histogram),
    vllm:disagg_kv_holds_expired_total

each with vLLM's own labels (model_name, engine). Imports vLLM (as connector.py does).
"""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from disagg.vllm import stats

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# name -> (help, the data key it adds up: a list's sum or length, or a count)
COUNTERS = {
    "loads": ("KV loads that landed (DisaggConnector, consumer)", "load_seconds", len),
    "loaded_bytes": ("Bytes of KV loaded into this server (DisaggConnector)", "load_bytes", sum),
    "load_failures": ("KV loads that failed (DisaggConnector; not those vLLM aborted)", "load_failures", None),
    "sends": ("KV sends that landed (DisaggConnector, producer)", "send_seconds", len),
    "sent_bytes": ("Bytes of KV sent from this server (DisaggConnector)", "send_bytes", sum),
    "send_failures": ("KV sends that failed (DisaggConnector)", "send_failures", None),
    "holds_expired": ("Prompts whose KV no consumer asked for within hold_s (DisaggConnector)", "holds_expired", None),
}
HISTOGRAMS = {
    "load_seconds": "Seconds from a load's start to its KV landing (DisaggConnector, consumer)",
    "send_seconds": "Seconds a KV send took (DisaggConnector, producer)",
}


class DisaggStats(KVConnectorStats):
    """disagg.vllm.stats data as vLLM's KVConnectorStats."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.summary(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class DisaggPromMetrics(KVConnectorPromMetrics):
    """The counters and histograms above, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:disagg_kv_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, (doc, _, _) in COUNTERS.items()
        }
        self.histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:disagg_kv_{key}", documentation=doc, buckets=SECONDS, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for key, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = stats.merge(stats.empty(), transfer_stats_data)
        for name, (_, key, fold) in COUNTERS.items():
            n = data[key] if fold is None else fold(data[key])
            if n:
                self.counters[name][engine_idx].inc(n)
        for key, per_engine in self.histograms.items():
            for seconds in data[key]:
                per_engine[engine_idx].observe(seconds)
