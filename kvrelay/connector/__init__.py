"""kvrelay's engine-agnostic NIXL KV connector.

Public API (CONTRACTS §4)::

    from kvrelay.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker
    from kvrelay.connector import CacheLayout, RequestView, ConnectorMetadata

Names resolve lazily so that importing `kvrelay.connector.protocol`, `kvrelay.connector.auth` or
`kvrelay.connector.sidechannel_client` (the proxy does) never pulls in torch or nixl.

Fixed call order, scheduler side (one `ConnectorScheduler` per engine, on its scheduler
thread), after `start()` and `set_xfer_handshake_metadata({rank: worker.get_handshake_metadata()})`:

1. ``n, is_async = sched.get_num_new_matched_tokens(req, num_computed_tokens)`` when a request
   is considered for scheduling: ``n`` tokens will arrive from a remote holder.
2. ``sched.update_state_after_alloc(req, block_ids, num_external_tokens)`` after the engine
   allocated the request's blocks (``num_external_tokens`` = the ``n`` it accepted, 0 if none).
3. ``meta = sched.build_connector_meta()`` once per engine step; every worker rank gets it via
   ``worker.start_load_kv(meta)``, then ``worker.get_finished()`` (each step; drives NIXL).
4. ``sched.update_connector_output(finished_sending, finished_recving, invalid_block_ids)``
   with what the workers reported: a request is ``finished_sending`` / ``finished_recving``
   only once EVERY rank reported it (`kvrelay.connector.tp.FinishedAggregator`, one per direction);
   invalid block ids are the union over ranks. Requests in ``finished_recving`` may be
   scheduled; ``sched.failed_requests()`` lists those that must error (policy ``fail``) and
   ``sched.loaded_tokens(request_id)`` says how many tokens really arrived (policy
   ``recompute``: the rest is prefilled locally).
5. ``delay_free, params = sched.request_finished(req, block_ids)`` when the request finishes:
   ``params`` go to the response; ``delay_free`` means the engine keeps the blocks until a
   worker reports the request in ``finished_sending``.
6. ``sched.request_rejected(req)`` when the engine refuses a request before admission: a
   holder it would have read from frees its blocks at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.connector.config import ConnectorConfig
    from kvrelay.connector.layout import CacheLayout
    from kvrelay.connector.metadata import ConnectorMetadata, RequestView
    from kvrelay.connector.scheduler import ConnectorScheduler
    from kvrelay.connector.worker import ConnectorWorker

__all__ = [
    "CacheLayout",
    "ConnectorConfig",
    "ConnectorMetadata",
    "ConnectorScheduler",
    "ConnectorWorker",
    "RequestView",
]

_LAZY = {
    "ConnectorConfig": "kvrelay.connector.config",
    "CacheLayout": "kvrelay.connector.layout",
    "ConnectorMetadata": "kvrelay.connector.metadata",
    "RequestView": "kvrelay.connector.metadata",
    "ConnectorScheduler": "kvrelay.connector.scheduler",
    "ConnectorWorker": "kvrelay.connector.worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
