"""Client request checks: JSON shape and field types, before anything is forwarded: the rules
`request_bodies` declares (`ChatRequest`, `CompletionRequest`), checked by hand for speed.

Reading the body itself (size, time, depth limits) is `kvrelay.proxy.http.body`.

The engines validate the rest; these checks exist so that malformed input gets a clear 4xx
from the proxy instead of a confusing engine error or a half-started P/D exchange.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvrelay.connector.protocol import KV_TRANSFER_PARAMS
from kvrelay.proxy.base import bad_request
from kvrelay.proxy.http.request_bodies import TOKEN_ID_LIMIT
from kvrelay.proxy.tenants import CACHE_SALT, check_client_salt

_DICT = {dict}
_STR = {str}
_INT = {int}
_LIST = {list}
_ROLE = itertools.repeat("role")


def _check_int(body: dict[str, Any], name: str, minimum: int) -> None:
    if name in body and body[name] is not None:
        value = body[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise bad_request(f"`{name}` must be an integer >= {minimum}", param=name)


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
    salt_problem = check_client_salt(body.get(CACHE_SALT))
    if salt_problem is not None:
        raise bad_request(salt_problem, param=CACHE_SALT)


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
    prompt: Any = body.get("prompt")  # JSON: the checks below narrow it
    if isinstance(prompt, str):
        return
    # The items' types taken at once, in C: a prompt of token ids runs to thousands of them.
    kinds = set(map(type, prompt)) if isinstance(prompt, list) else None
    if kinds == _STR:
        return
    if kinds == _INT:
        ids_ok = _in_range(prompt)
    elif kinds == _LIST:  # a batch of token prompts: each a list of ids
        ids_ok = all(map(_token_ids_ok, prompt))
    else:  # not a list, an empty one, or one of mixed or other items
        raise bad_request(
            "`prompt` must be a string, an array of strings or an array of token ids",
            param="prompt",
        )
    if not ids_ok:
        raise bad_request("`prompt` token ids must be integers from 0 to 2^63 - 1", param="prompt")


def _token_ids_ok(ids: list[Any]) -> bool:
    """Every item an int (a bool is not one here) from 0 to `TOKEN_ID_LIMIT` - 1."""
    return not ids or (set(map(type, ids)) == _INT and _in_range(ids))


def _in_range(ids: list[int]) -> bool:
    return min(ids) >= 0 and max(ids) < TOKEN_ID_LIMIT
