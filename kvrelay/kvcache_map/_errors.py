"""The map's exception types, kept apart so every module can raise them without cycles."""

from __future__ import annotations


class MapUnavailableError(Exception):
    """The backing store is down or too slow; the caller should serve without KV reuse.

    The one error a backend raises for every connectivity problem (refused, reset, timed out,
    authentication, server busy/loading). Maps recover by themselves once the store is back.
    """


class InvalidKeyError(ValueError):
    """A `ConversationKey` no backend accepts (wrong types, empty conversation id)."""


class KeyTooLongError(InvalidKeyError):
    """A key part exceeds its byte limit (`MAX_TENANT_BYTES`, `MAX_CONVERSATION_ID_BYTES`)."""


class EntryDecodeError(ValueError):
    """Stored bytes are not a valid `KVEntry` (maps count these as corrupt misses)."""
