"""Talking to engines: the engine-facing HTTP/1.1 client (`Upstream`), releases of held blocks
and finished-params lookups on the engines' side channels (`Releaser`, `FinishedLookups`), and
the prompt tokens an engine counts for a request (`prompt_tokens`).
"""

from kvrelay.proxy.engines.finished_lookups import FinishedLookups
from kvrelay.proxy.engines.release import RELEASE_ATTEMPTS, Releaser
from kvrelay.proxy.engines.token_count import prompt_token_ids, prompt_tokens
from kvrelay.proxy.engines.upstream import (
    H1Response,
    Origin,
    Upstream,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = [
    "RELEASE_ATTEMPTS",
    "FinishedLookups",
    "H1Response",
    "Origin",
    "Releaser",
    "Upstream",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
    "prompt_token_ids",
    "prompt_tokens",
]
