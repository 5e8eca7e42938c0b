"""kvrelay's engine-agnostic NIXL KV connector.

Public API (CONTRACTS §4)::

    from kvrelay.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker
    from kvrelay.connector import CacheLayout, RequestView, ConnectorMetadata
    from kvrelay.connector import ConnectorError, ConnectorErrorKind

Every exception the connector raises on purpose is a `ConnectorError` whose `kind` (an enum,
`kvrelay.connector.errors`) says what failed.

Names resolve lazily so that importing `kvrelay.connector.protocol`, `kvrelay.connector.auth` or
`kvrelay.connector.sidechannel_client` (the proxy does) never pulls in torch or nixl.

The call order (start, handshake metadata, then per request: ask, allocate, metadata to every
rank, the workers' output back, finish or reject), with what each call may answer and what the
engine must do with it, is written once: docs/CONTRACTS.md §4.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.connector.config import ConnectorConfig
    from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
    from kvrelay.connector.layout import CacheLayout
    from kvrelay.connector.metadata import ConnectorMetadata, RequestView
    from kvrelay.connector.scheduler import ConnectorScheduler
    from kvrelay.connector.worker import ConnectorWorker

__all__ = [
    "CacheLayout",
    "ConnectorConfig",
    "ConnectorError",
    "ConnectorErrorKind",
    "ConnectorMetadata",
    "ConnectorScheduler",
    "ConnectorWorker",
    "RequestView",
]

_LAZY = {
    "ConnectorConfig": "kvrelay.connector.config",
    "ConnectorError": "kvrelay.connector.errors",
    "ConnectorErrorKind": "kvrelay.connector.errors",
    "CacheLayout": "kvrelay.connector.layout",
    "ConnectorMetadata": "kvrelay.connector.metadata",
    "RequestView": "kvrelay.connector.metadata",
    "ConnectorScheduler": "kvrelay.connector.scheduler",
    "ConnectorWorker": "kvrelay.connector.worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
