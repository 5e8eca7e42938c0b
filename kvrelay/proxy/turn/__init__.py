"""One turn of a conversation: what it knows (`TurnContext`), what it decides and does
(`Turn`: take its entry, plan it, the P and D legs, relay the answer, store what D holds, free
what the turn owes) and what it reports (`TurnReport`), with what the engines reported it
reused (`PromptAccount`, `TurnAccounts`).

A worker's turns share a `TurnCrew` (the parts of its fleet they use). A turn talks to its
client through `Client` (`AiohttpClient` for the proxy's server) and to engines through
`Engines` (the worker's engine client unless a test gives it another). A turn whose prompt's
prefix another P caches may have that P pin it for its own P to pull (`prefix_pin`).
"""

from kvrelay.proxy.turn.accounting import PromptAccount, TurnAccounts
from kvrelay.proxy.turn.attempts import Engines, LegFailure, UpstreamEngines
from kvrelay.proxy.turn.client import AiohttpClient, Client
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.conversation import (
    CONVERSATION_HEADER,
    FINGERPRINT_PREFIX,
    MAX_ID_LEN,
    SESSION_HEADER,
    chat_shape,
    completion_shape,
    conversation_id_from,
    request_id_from,
    tenant_of,
    upstream_request_id,
)
from kvrelay.proxy.turn.crew import TurnCrew
from kvrelay.proxy.turn.relay import Turn
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.settings import TurnSettings

__all__ = [
    "CONVERSATION_HEADER",
    "FINGERPRINT_PREFIX",
    "MAX_ID_LEN",
    "SESSION_HEADER",
    "AiohttpClient",
    "Client",
    "Engines",
    "LegFailure",
    "PromptAccount",
    "Turn",
    "TurnAccounts",
    "TurnContext",
    "TurnCrew",
    "TurnReport",
    "TurnSettings",
    "UpstreamEngines",
    "chat_shape",
    "completion_shape",
    "conversation_id_from",
    "request_id_from",
    "tenant_of",
    "upstream_request_id",
]
