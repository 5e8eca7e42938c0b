"""One turn of a conversation: what it knows (`TurnContext`), what it decides and does
(`Turn`: take its entry, plan it, the P and D legs, relay the answer, store what D holds, free
what the turn owes) and what it reports (`TurnReport`), with what the engines reported it
reused (`PromptAccount`, `TurnAccounts`).

A worker's turns share a `TurnCrew` (the parts of its fleet they use). A turn talks to its
client through `Client` (`AiohttpClient` for the proxy's server) and to engines through
`Engines` (the worker's engine client unless a test gives it another). A turn whose prompt's
prefix another P caches may have that P pin it for its own P to pull (`PrefixPin`).
"""

from kvrelay.proxy.turn.accounting import PromptAccount, TurnAccounts
from kvrelay.proxy.turn.attempts import EngineAnswer, Engines, LegFailure, UpstreamEngines
from kvrelay.proxy.turn.client import AiohttpClient, Client, ClientStream
from kvrelay.proxy.turn.context import TurnContext
from kvrelay.proxy.turn.conversation import (
    CONVERSATION_HEADER,
    SESSION_HEADER,
    chained_fingerprints,
    chat_shape,
    chat_store_key_id,
    completion_shape,
    conversation_id_from,
    prompt_chars,
    request_id_from,
    tenant_of,
    upstream_request_id,
)
from kvrelay.proxy.turn.crew import TurnCrew
from kvrelay.proxy.turn.legs import (
    capped_num_tokens,
    decode_body,
    prefill_body,
    prefill_priority,
)
from kvrelay.proxy.turn.owed import Debt, Owed
from kvrelay.proxy.turn.prefill_leg import read_prefill_answer
from kvrelay.proxy.turn.prefix_pin import PrefixPin, pin_body
from kvrelay.proxy.turn.relay import Turn
from kvrelay.proxy.turn.report import TurnReport
from kvrelay.proxy.turn.settings import TurnSettings
from kvrelay.proxy.turn.streaming import SSEFilter

__all__ = [
    "CONVERSATION_HEADER",
    "SESSION_HEADER",
    "AiohttpClient",
    "Client",
    "ClientStream",
    "Debt",
    "EngineAnswer",
    "Engines",
    "LegFailure",
    "Owed",
    "PrefixPin",
    "PromptAccount",
    "SSEFilter",
    "Turn",
    "TurnAccounts",
    "TurnContext",
    "TurnCrew",
    "TurnReport",
    "TurnSettings",
    "UpstreamEngines",
    "capped_num_tokens",
    "chained_fingerprints",
    "chat_shape",
    "chat_store_key_id",
    "completion_shape",
    "conversation_id_from",
    "decode_body",
    "pin_body",
    "prefill_body",
    "prefill_priority",
    "prompt_chars",
    "read_prefill_answer",
    "request_id_from",
    "tenant_of",
    "upstream_request_id",
]
