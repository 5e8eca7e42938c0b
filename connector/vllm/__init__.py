"""vLLM integration of the kvrelay connector (the adapter lives in `connector.vllm_adapter`).

Modules here map vLLM's objects onto the engine-agnostic core: `layout` (vLLM's KV cache
tensors -> `CacheLayout`, torch only), `requests` (vLLM `Request` -> `RequestView`, no vLLM
import), `settings` (vLLM config -> `ConnectorConfig`, with the start-up checks), and `stats`
(vLLM's `KVConnectorStats` / Prometheus hooks, imports vLLM). Nothing here is imported by the
proxy or by the main test suite's code paths; only vLLM loads it, through
`kv_connector_module_path: "connector.vllm_adapter"`.
"""
