"""vLLM integration of the kvrelay connector (the adapter is `kvrelay.connector.vllm.adapter`).

Modules here map vLLM's objects onto the engine-agnostic core: `layout` (vLLM's KV cache
tensors -> `CacheLayout`, torch only), `requests` (vLLM `Request` -> `RequestView`, no vLLM
import), `settings` (vLLM config -> `ConnectorConfig`, with the start-up checks), and `stats`
(vLLM's `KVConnectorStats` / Prometheus hooks, imports vLLM). Nothing here is imported by the
proxy or by the main test suite's code paths; only vLLM loads it, through
`kv_connector_module_path: "kvrelay.connector.vllm.adapter"`.
"""
