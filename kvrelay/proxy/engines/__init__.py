"""Talking to engines: the engine-facing HTTP/1.1 client (`Upstream`), releases of held blocks
and finished-params lookups on the engines' side channels (`Releaser`), and
the prompt tokens an engine counts for a request (`prompt_tokens`).
"""

from kvrelay.proxy.engines.release import Releaser
from kvrelay.proxy.engines.token_count import prompt_token_ids, prompt_tokens
from kvrelay.proxy.engines.upstream import (
    H1Response,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = [
    "H1Response",
    "Releaser",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "prompt_token_ids",
    "prompt_tokens",
]
