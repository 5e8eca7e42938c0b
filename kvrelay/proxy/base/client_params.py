"""What a client may not say to the engines' connector: its `kv_transfer_params`, wherever an
engine would read them. Used by every room that builds a body for an engine (the turn's legs,
the HTTP routes, pass-through)."""

from __future__ import annotations

from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS

VLLM_XARGS = "vllm_xargs"
SAMPLING_PARAMS = "sampling_params"  # vLLM's token-in route: the whole SamplingParams
EXTRA_ARGS = "extra_args"


def strip_connector_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without any client-supplied `kv_transfer_params`, wherever an engine reads them.

    vLLM takes a request's connector params from the top-level field and, failing that, from
    `vllm_xargs` (copied into the sampling params' `extra_args`, where the scheduler looks them
    up): a value there of any type reaches the connector unchecked. vLLM's token-in route
    (`/inference/v1/generate`) takes a whole `sampling_params` object, whose `extra_args` the
    scheduler reads the same way. Only the proxy speaks to the connector, so all three are
    removed on every route (chat, completions, pass-through, each leg). Changes `body` in place
    and returns it.
    """
    body.pop(KV_TRANSFER_PARAMS, None)
    _drop_params(body, VLLM_XARGS)
    sampling = body.get(SAMPLING_PARAMS)
    if isinstance(sampling, dict) and isinstance(sampling.get(EXTRA_ARGS), dict):
        body[SAMPLING_PARAMS] = sampling = dict(sampling)  # the client's object stays as sent
        _drop_params(sampling, EXTRA_ARGS)
    return body


def _drop_params(holder: dict[str, Any], name: str) -> None:
    """`holder[name]` without `kv_transfer_params`, when it is an object that has them."""
    inner = holder.get(name)
    if isinstance(inner, dict) and KV_TRANSFER_PARAMS in inner:
        holder[name] = {k: v for k, v in inner.items() if k != KV_TRANSFER_PARAMS}
