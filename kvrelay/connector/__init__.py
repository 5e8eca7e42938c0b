"""kvrelay's engine-agnostic NIXL KV connector.

Public API (CONTRACTS §4)::

    from kvrelay.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker
    from kvrelay.connector import CacheLayout, RequestView, ConnectorMetadata
    from kvrelay.connector import ConnectorError, ConnectorErrorKind

Every exception the connector raises on purpose is a `ConnectorError` whose `kind` (an enum,
`kvrelay.connector.errors`) says what failed.

Names resolve lazily so that importing `kvrelay.connector.protocol`, `kvrelay.connector.auth` or
`kvrelay.connector.sidechannel_client` (the proxy does) never pulls in torch or nixl.

Fixed call order, scheduler side (one `ConnectorScheduler` per engine, on its scheduler
thread), after `start()` and `set_xfer_handshake_metadata({rank: worker.get_handshake_metadata()})`:

1. ``n, is_async = sched.get_num_new_matched_tokens(req, num_computed_tokens)`` each time a
   request with nothing computed is considered for admission (again after a failed
   allocation, with the new local prefix hit; again after preemption): ``n`` tokens will
   arrive from a remote holder. ``is_async`` is true only when ``n > 0``. A request whose load
   already ran (or whose holder was released) always gets ``(0, False)``: it loads at most once.
2. ``sched.update_state_after_alloc(req, block_ids, num_external_tokens)`` after the engine
   allocated the request's blocks (``num_external_tokens`` = the ``n`` it accepted, 0 if none).
3. ``meta = sched.build_connector_meta()`` once per engine step; every worker rank gets it via
   ``worker.start_load_kv(meta)``, then ``worker.get_finished()`` (each step; drives NIXL).
4. ``sched.update_connector_output(finished_sending, finished_recving, invalid_block_ids)``
   with what the workers reported: a request is ``finished_sending`` / ``finished_recving``
   only once EVERY rank reported it (`kvrelay.connector.tp.FinishedAggregator`, one per direction;
   each rank reports an id once, so counting reports as vLLM does gives the same answer);
   invalid block ids are the union over ranks. Requests in ``finished_recving`` may be
   scheduled; ``sched.failed_requests()`` lists those that must error (policy ``fail``) and
   ``sched.loaded_tokens(request_id)`` says how many tokens really arrived (policy
   ``recompute``: the rest is prefilled locally). Only ids the engine expects are reported:
   ``finished_sending`` = requests it holds blocks for (each once), ``finished_recving`` =
   requests whose load was planned (each once, also when the load failed before it started).
5. ``delay_free, params = sched.request_finished(req, block_ids)`` when the request finishes:
   ``params`` go to the response; ``delay_free`` means the engine keeps the blocks until a
   worker reports the request in ``finished_sending``. A request that finishes (aborts) while
   its load is in flight gets ``(False, None)``: the engine keeps its blocks until the load
   shows up in ``finished_recving`` and frees them then (vLLM does this by itself).
6. ``sched.request_rejected(req)`` when the engine refuses a request before admission: a
   holder it would have read from frees its blocks at once.
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
        raise AttributeError(f"module 'connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
