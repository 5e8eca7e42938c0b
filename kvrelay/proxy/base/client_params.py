"""What a client may not say to the engines' connector: its `kv_transfer_params`, wherever an
engine would read them. Used by every room that builds a body for an engine (the turn's legs,
the HTTP routes, pass-through)."""

from __future__ import annotations

from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS

VLLM_XARGS = "vllm_xargs"


def strip_connector_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without any client-supplied `kv_transfer_params`, wherever an engine reads them.

    vLLM takes a request's connector params from the top-level field and, failing that, from
    `vllm_xargs` (copied into the sampling params' `extra_args`, where the scheduler looks them
    up): a value there of any type reaches the connector unchecked. Only the proxy speaks to the
    connector, so both are removed on every route (chat, completions, pass-through, each leg).
    Changes `body` in place and returns it.
    """
    body.pop(KV_TRANSFER_PARAMS, None)
    xargs = body.get(VLLM_XARGS)
    if isinstance(xargs, dict) and KV_TRANSFER_PARAMS in xargs:
        body[VLLM_XARGS] = {k: v for k, v in xargs.items() if k != KV_TRANSFER_PARAMS}
    return body
