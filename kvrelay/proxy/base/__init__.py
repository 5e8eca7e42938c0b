"""What every room of the proxy uses: the OpenAI-shaped error (`ProxyError`), the JSON codec,
stopping background tasks, and the connector fields no client may send.
"""

from kvrelay.proxy.base import jsoncodec
from kvrelay.proxy.base.background import cancel_and_wait
from kvrelay.proxy.base.client_params import VLLM_XARGS, strip_connector_fields
from kvrelay.proxy.base.errors import (
    ProxyError,
    bad_request,
    json_response,
    upstream_error_from_body,
)

__all__ = [
    "VLLM_XARGS",
    "ProxyError",
    "bad_request",
    "cancel_and_wait",
    "json_response",
    "jsoncodec",
    "strip_connector_fields",
    "upstream_error_from_body",
]
