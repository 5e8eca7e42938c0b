"""What a turn knows from its request, fixed before anything is decided: `TurnContext`.

Built once per request (`TurnContext.of`) and never changed: the route, the body as validated,
the ids, the tenant, the prompt's shape, whether it streams, the map keys it looks up and
stores under, and its prompt's size in characters. Every step of the turn reads it; none writes
it. What the turn decides lives on `kvrelay.proxy.turn.relay.Turn`, what it reports on its
`TurnReport`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvrelay.kvcache_map import ConversationKey
from kvrelay.proxy.turn.conversation import PromptShape, chat_store_key_id, prompt_chars


# A NamedTuple: immutable like a frozen dataclass, without the frozen dataclass's per-field
# `object.__setattr__` on every request.
class TurnContext(NamedTuple):
    """One request as the turn knows it (see the module's docstring)."""

    route: str  # "chat" | "completions"
    body: dict[str, Any]
    request_id: str  # upstream id, on both legs
    tenant: str
    shape: PromptShape
    conversation_id: str | None
    client_request_id: str  # what the client sees in X-Request-Id
    forwarded: tuple[tuple[str, str], ...]  # client headers for the engines (forward_headers)
    stream: bool
    lookup_key: ConversationKey | None  # the map key of the previous turn's entry
    store_key: ConversationKey | None  # ... and the key this turn's entry is stored under
    work: int  # the prompt's characters + 1: a cheap stand-in for its prefill work

    @classmethod
    def of(
        cls,
        *,
        route: str,
        body: dict[str, Any],
        request_id: str,
        tenant: str,
        shape: PromptShape,
        conversation_id: str | None = None,
        client_request_id: str = "",
        forwarded: tuple[tuple[str, str], ...] = (),
        fingerprint_conversations: bool = True,
    ) -> TurnContext:
        """The context of one request; `fingerprint_conversations`: a chat without a
        conversation id is matched by its history (the setting of that name)."""
        fingerprinting = route == "chat" and fingerprint_conversations
        return cls(
            route=route,
            body=body,
            request_id=request_id,
            tenant=tenant,
            shape=shape,
            conversation_id=conversation_id,
            client_request_id=client_request_id,
            forwarded=forwarded,
            stream=body.get("stream") is True,
            lookup_key=_lookup_key(tenant, conversation_id, shape, fingerprinting),
            store_key=_store_key(tenant, conversation_id, shape, fingerprinting),
            work=prompt_chars(route, body) + 1,
        )


def _lookup_key(
    tenant: str, conversation_id: str | None, shape: PromptShape, fingerprinting: bool
) -> ConversationKey | None:
    if conversation_id is not None:
        return ConversationKey(tenant, conversation_id)
    if fingerprinting and shape.lookup_key_id is not None:
        return ConversationKey(tenant, shape.lookup_key_id)
    return None


def _store_key(
    tenant: str, conversation_id: str | None, shape: PromptShape, fingerprinting: bool
) -> ConversationKey | None:
    if shape.store_fingerprint is None:
        return None
    if conversation_id is not None:
        return ConversationKey(tenant, conversation_id)
    if fingerprinting:
        key_id = chat_store_key_id(shape)
        return ConversationKey(tenant, key_id) if key_id else None
    return None
