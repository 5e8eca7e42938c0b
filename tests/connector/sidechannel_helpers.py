"""Helpers for in-process scheduler tests: hold a request, run a holder's engine step."""

from __future__ import annotations

from typing import Any

from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler


def hold_params(
    sched: ConnectorScheduler, rid: str, n_tokens: int = 10, client: str | None = None
) -> dict[str, Any]:
    tokens = list(range(n_tokens + 1))
    view = RequestView(rid, client, tokens[:n_tokens], tokens, {"do_remote_decode": True})
    blocks = list(range(100, 100 + (n_tokens + 3) // 4 + 1))
    delay, params = sched.request_finished(view, [blocks])
    assert delay and params is not None
    return params


def drain(sched: ConnectorScheduler) -> set[str]:
    """One engine step as a holder with no readers: free what the scheduler ordered freed."""
    frees = sched.build_connector_meta().reqs_to_free
    sched.update_connector_output(frees, set(), set())
    return frees
