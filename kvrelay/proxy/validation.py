"""Client request checks: JSON shape and field types, before anything is forwarded.

Reading the body itself (size, time, depth limits) is `kvrelay.proxy.body`.

The engines validate the rest; these checks exist so that malformed input gets a clear 4xx
from the proxy instead of a confusing engine error or a half-started P/D exchange.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS
from kvrelay.proxy.errors import bad_request

_DICT = {dict}
_STR = {str}
_ROLE = itertools.repeat("role")


def _check_int(body: dict[str, Any], name: str, minimum: int) -> None:
    if name in body and body[name] is not None:
        value = body[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise bad_request(f"`{name}` must be an integer >= {minimum}", param=name)


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


def validate_common(body: dict[str, Any]) -> None:
    if KV_TRANSFER_PARAMS in body:
        raise bad_request(
            "`kv_transfer_params` is set by the proxy and cannot be sent by clients; "
            "remove it from the request",
            param=KV_TRANSFER_PARAMS,
        )
    if "model" in body and not isinstance(body["model"], str):
        raise bad_request("`model` must be a string", param="model")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise bad_request("`stream` must be true or false", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options")
    _check_int(body, "max_tokens", 1)
    _check_int(body, "max_completion_tokens", 1)
    _check_int(body, "n", 1)


def validate_chat(body: dict[str, Any]) -> None:
    validate_common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty array of messages", param="messages")
    # Passes in C for the usual history (objects, each with a string role); a long chat has
    # hundreds of messages. Anything else is looked at one message at a time, for the error.
    if set(map(type, messages)) == _DICT and set(map(type, map(dict.get, messages, _ROLE))) == _STR:
        return
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(
                f"`messages[{i}]` must be an object with a string `role`",
                param=f"messages[{i}]",
            )


def validate_completion(body: dict[str, Any]) -> None:
    validate_common(body)
    prompt = body.get("prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) for p in prompt)
        )
    )
    if not ok:
        raise bad_request(
            "`prompt` must be a string, an array of strings or an array of token ids",
            param="prompt",
        )
