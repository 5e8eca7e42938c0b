"""What every room of the proxy uses: the OpenAI-shaped error (`ProxyError`), the JSON codec,
stopping background tasks, the connector fields no client may send, and which engine counts
are believed (`count_or_none`).
"""

from kvrelay.proxy.base import jsoncodec
from kvrelay.proxy.base.background import cancel_and_wait
from kvrelay.proxy.base.client_params import VLLM_XARGS, strip_connector_fields
from kvrelay.proxy.base.engine_counts import MAX_ENGINE_COUNT, count_or_none
from kvrelay.proxy.base.errors import (
    ProxyError,
    bad_request,
    json_response,
    upstream_error_from_body,
)

__all__ = [
    "MAX_ENGINE_COUNT",
    "VLLM_XARGS",
    "ProxyError",
    "bad_request",
    "cancel_and_wait",
    "count_or_none",
    "json_response",
    "jsoncodec",
    "strip_connector_fields",
    "upstream_error_from_body",
]
