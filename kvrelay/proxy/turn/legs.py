"""Building the two legs of a disaggregated request from the client's body.

P (prefill) gets the prompt with `max_tokens=1`, no streaming, and `kv_transfer_params`
asking it to keep its KV for D (`do_remote_decode`) — plus, on a reuse hit, where D's blocks
from the previous turn are so P can pull them. D (decode) gets the client's request unchanged
except for P's params (`do_remote_prefill`) and `hold_blocks`, which asks D to keep its KV for
the conversation's next turn.
"""

from __future__ import annotations

from typing import Any

from kvrelay.connector.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    HOLD_BLOCKS,
    HOLD_BRIEF,
    HOLD_OWNER,
    KV_TRANSFER_PARAMS,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_URL,
    KVTransferParams,
)
from kvrelay.proxy.base import strip_connector_fields

# Fields that only make sense for the client-facing leg or would make P generate more.
_P_DROPPED = frozenset({"stream_options", "min_tokens", "min_completion_tokens", "n", "best_of"})


def prefill_body(
    body: dict[str, Any], reuse_params: KVTransferParams | None, priority: int | None = None
) -> dict[str, Any]:
    """P's request: one token, no stream, keep the KV for D, maybe pull the old turn's KV;
    with `priority`, vLLM's request priority in place of the client's (`prefill_priority`)."""
    out = dict(body)
    if priority is not None:
        out["priority"] = priority
    if not _P_DROPPED.isdisjoint(out):  # a scan in C; most bodies have none of them
        for name in _P_DROPPED.intersection(out):
            del out[name]
    strip_connector_fields(out)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if reuse_params is not None:
        params = reuse_params.to_wire()
        params[DO_REMOTE_DECODE] = True
        params[DO_REMOTE_PREFILL] = False
    else:
        params = {
            DO_REMOTE_DECODE: True,
            DO_REMOTE_PREFILL: False,
            REMOTE_ENGINE_ID: None,
            REMOTE_BLOCK_IDS: None,
            REMOTE_HOST: None,
            REMOTE_PORT: None,
        }
    out[KV_TRANSFER_PARAMS] = params
    return out


def prefill_priority(chars: int, chars_per_token: float, tokens_per_level: int) -> int | None:
    """The vLLM priority of a request to P that computes about `chars` characters of prompt:
    its tokens over `tokens_per_level`, rounded down, so that shorter prefills run first on a P
    under `--scheduling-policy priority` (lower first) while prompts within one level keep
    their arrival order; None with `tokens_per_level` 0 (`prefill_priority_tokens` off)."""
    if tokens_per_level <= 0:
        return None
    return int(max(0, chars) / chars_per_token) // tokens_per_level


def decode_body(
    body: dict[str, Any],
    prefill: KVTransferParams | None,
    prefill_url: str | None,
    hold: bool,
    owner: str = "",
    brief: bool = False,
) -> dict[str, Any]:
    """D's request: the client's, with P's params (parsed where P's answer came in; none:
    decode-only) and `hold_blocks` with the hold's `owner` (the tenant: D shares its hold
    budget fairly among owners) and, with `brief`, `hold_brief` (a hold over D's max is kept
    for D's brief lease instead of declined)."""
    out = strip_connector_fields(dict(body))
    params: dict[str, Any] = {}
    # The model's own set of given fields and its extras (pinned in tests/test_private_apis.py):
    # pydantic's public names for them are properties, a call each on every turn.
    if prefill is not None and (prefill.__pydantic_fields_set__ or prefill.__pydantic_extra__):
        params.update(prefill.to_wire())
        params[DO_REMOTE_PREFILL] = True
        params[DO_REMOTE_DECODE] = False
        if prefill_url is not None:
            params[REMOTE_URL] = prefill_url
    if hold:
        # Stock vLLM ignores the flag (and holds anyway); kvrelay's D holds only on request.
        params[HOLD_BLOCKS] = True
        if owner:
            params[HOLD_OWNER] = owner
        if brief:
            params[HOLD_BRIEF] = True
    if params:
        out[KV_TRANSFER_PARAMS] = params
    return out


def capped_num_tokens(params: KVTransferParams, cap: int | None) -> int | None:
    """`remote_num_tokens` limited to `cap` (stock engines: the previous prompt's tokens)."""
    value = params.remote_num_tokens
    if value is None:
        return None
    return min(value, cap) if cap is not None else value
