"""kvrelay: a multi-turn routing proxy for disaggregated (prefill/decode) LLM serving.

Subpackages, in reading order: `kvrelay.proxy` (the OpenAI-compatible proxy),
`kvrelay.kvcache_map` (conversation -> held KV blocks), `kvrelay.connector` (the NIXL KV
connector and its vLLM adapter, `kvrelay.connector.vllm.adapter`), `kvrelay.enginesim` (a CPU
engine simulator that drives the connector as vLLM does). Importing this package imports none
of them, so the proxy never pulls in torch or nixl.
"""

__version__ = "0.1.0"
