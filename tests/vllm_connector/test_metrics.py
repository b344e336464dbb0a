"""DisaggConnector's transfer figures through vLLM's own stats path (no model run): two worker
connectors (TP ranks) hand them over with their finished sends (get_kv_connector_stats), vLLM's
KVOutputAggregator adds the ranks up, its real scheduler puts them in SchedulerStats, and vLLM's
KVConnectorLogging and KVConnectorProm turn them into the log line and the /metrics series.
(The figures of real transfers: test_worker.py; on real servers' /metrics: test_e2e.py.)"""

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.outputs import KVConnectorOutput

from disagg.vllm import stats
from disagg.vllm.connector import DisaggConnector
from disagg.vllm.stats import End, Ended

BS = 16
BOOT = "tcp://127.0.0.1:8998"


def _config(u, model):
    return u.create_vllm_config(
        model=str(model),
        block_size=BS,
        kv_connector="DisaggConnector",
        kv_connector_module_path="disagg.vllm.connector",
        kv_role="kv_producer",
        kv_connector_extra_config={"bootstrap": BOOT},
        dtype="float32",
    )


def _rank_output(u, cfg, req_id: str, ends: list[Ended]):
    """One TP rank's worker connector after its loop reported `req_id` sent (`ends`: how its
    sends went): the output vLLM's model runner builds from it."""
    conn = DisaggConnector(cfg, KVConnectorRole.WORKER)
    try:
        for e in ends:
            conn._worker.sending.sent(req_id, e)
        results = conn.get_transfer_results(set())
        out = u.create_model_runner_output([])
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            kv_connector_stats=conn.get_kv_connector_stats(),
        )
        assert conn.get_kv_connector_stats() is None  # each figure is handed over once
        return out
    finally:
        conn.shutdown()


def _sample(name: str) -> float:
    return sum(
        s.value for m in REGISTRY.collect() for s in m.samples if s.name == name and s.labels.get("engine") == "0"
    )


def test_the_workers_figures_reach_vllms_log_line_and_prometheus_metrics(vllm_utils, tiny_llama):
    u = vllm_utils
    cfg = _config(u, tiny_llama)
    s = u.create_scheduler(cfg, num_blocks=64)
    req = u.create_request(num_tokens=40, do_remote_decode=True, block_size=BS)
    s.add_request(req)
    s.update_from_output(s.schedule(), u.create_model_runner_output([req]))
    ranks = [
        _rank_output(u, cfg, req.request_id, [Ended(End.MOVED, 0.004, 3000)]),
        _rank_output(u, cfg, req.request_id, [Ended(End.MOVED, 0.002, 1000), Ended(End.EXPIRED)]),
    ]
    merged = KVOutputAggregator(2).aggregate(ranks)
    eco = s.update_from_output(s.schedule(), merged)
    data = eco[0].scheduler_stats.kv_connector_stats
    assert (data["send_bytes"], data["send_seconds"], data["holds_expired"]) == ([3000, 1000], [0.004, 0.002], 1)

    lines = []
    logging = KVConnectorLogging(cfg.kv_transfer_config)
    logging.observe(data)
    logging.observe(stats.merge(stats.empty(), {"load_failures": 2}))  # a later step's
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == [
        "KV Transfer metrics: loads=0, load failures=2, sends=2, send ms avg=3.0, send ms max=4.0, "
        "send MB=0.004, send failures=0, holds expired=1"
    ]

    unregister_vllm_metrics()  # (none of ours registered before)
    prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(data, 0)
    assert _sample("vllm:disagg_kv_sent_bytes_total") == 4000
    assert _sample("vllm:disagg_kv_sends_total") == 2
    assert _sample("vllm:disagg_kv_holds_expired_total") == 1
    assert _sample("vllm:disagg_kv_send_seconds_count") == 2
    assert _sample("vllm:disagg_kv_send_seconds_sum") == pytest.approx(0.006)
    assert _sample("vllm:disagg_kv_loaded_bytes_total") == 0
    assert _sample("vllm:disagg_kv_load_failures_total") == 0  # the log's later step is not this one's
