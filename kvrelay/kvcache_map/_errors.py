"""The map's exception types, kept apart so every module can raise them without cycles."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class MapUnavailableError(Exception):
    """The backing store is down or too slow; the caller should serve without KV reuse.

    The one error a backend raises for every connectivity problem (refused, reset, timed out,
    authentication, server busy/loading). Maps recover by themselves once the store is back.
    """


class UnconfirmedPutError(MapUnavailableError):
    """A `put` whose outcome is unknown: it timed out, its connection was lost after the
    command went out, or too few replicas confirmed it. The entry may be in the map, or may
    still land there, so the caller must not free its blocks yet.

    `await settle()` decides it: True when the put was stored (the map holds the entry as
    after any put: a reader may take it, an expiry or a later put reports it), False when it
    was not and now never will be (the caller owns the blocks again and frees them). Raises
    `MapUnavailableError` while the store still cannot answer (try again later; the blocks'
    own lease is the last resort). Idempotent.
    """

    def __init__(self, message: str, settle: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(message)
        self.settle = settle


class InvalidKeyError(ValueError):
    """A `ConversationKey` no backend accepts (wrong types, empty conversation id)."""


class KeyTooLongError(InvalidKeyError):
    """A key part exceeds its byte limit (`MAX_TENANT_BYTES`, `MAX_CONVERSATION_ID_BYTES`)."""


class EntryDecodeError(ValueError):
    """Stored bytes are not a valid `KVEntry` (maps count these as corrupt misses)."""
