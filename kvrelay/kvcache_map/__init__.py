"""kvcache_map: conversation → the KV blocks a decode engine still holds for it.

Public API (pinned in docs/CONTRACTS.md §3); implementation lives in the private modules.
"""

from kvrelay.kvcache_map._base import EvictionCallback, EvictionReason, KVMap, MapStats
from kvrelay.kvcache_map._entry import (
    MAX_CONVERSATION_ID_BYTES,
    MAX_TENANT_BYTES,
    ConversationKey,
    KVEntry,
    decode_key,
    encode_key,
)
from kvrelay.kvcache_map._errors import (
    EntryDecodeError,
    InvalidKeyError,
    KeyTooLongError,
    MapUnavailableError,
    UnconfirmedPutError,
)
from kvrelay.kvcache_map._memory import MemoryMap
from kvrelay.kvcache_map._redis import RedisMap
from kvrelay.kvcache_map._url import open_map, open_redis_client

__all__ = [
    "MAX_CONVERSATION_ID_BYTES",
    "MAX_TENANT_BYTES",
    "ConversationKey",
    "EntryDecodeError",
    "EvictionCallback",
    "EvictionReason",
    "InvalidKeyError",
    "KVEntry",
    "KVMap",
    "KeyTooLongError",
    "MapStats",
    "MapUnavailableError",
    "MemoryMap",
    "RedisMap",
    "UnconfirmedPutError",
    "decode_key",
    "encode_key",
    "open_map",
    "open_redis_client",
]
