"""How many prompt tokens an engine counts for a request: its own `/tokenize`.

The proxy has no tokenizer, and a prompt's characters say little about its tokens: emoji or
CJK text run to one token per character or more, where English runs about four characters to a
token. A bound the proxy enforces with a client's characters can be steered by that client, so
the bounds that keep a decode engine's prefill short (a decode-only or spilled turn) are
checked on the count of the engine that would prefill the prompt, asked with the prompt as the
engine would render it (vLLM's `/tokenize` takes a chat's `messages` and the request's template
fields, or a completion's `prompt`). A completion given token ids is counted as it is.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrelay.proxy.base import count_or_none, jsoncodec
from kvrelay.proxy.engines.upstream import Upstream, UpstreamError

log = logging.getLogger(__name__)

# The request fields that change how vLLM renders a chat prompt; `/tokenize` takes each of them.
_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)
_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")


async def prompt_tokens(
    upstream: Upstream, url: str, route: str, body: dict[str, Any], timeout_s: float
) -> int | None:
    """The prompt tokens of `body` (a chat or completions request) by the engine at `url`;
    None when it cannot say (no answer in time, an error, a batch of prompts)."""
    given = _given_ids(route, body)
    if given is not None:
        return len(given)
    answer = await _tokenize(upstream, url, route, body, timeout_s)
    count = answer.get("count") if answer is not None else None
    return count_or_none(count) or None  # a prompt has at least one token


async def prompt_token_ids(
    upstream: Upstream, url: str, route: str, body: dict[str, Any], timeout_s: float
) -> list[int] | None:
    """The prompt's token ids as the engine at `url` renders and tokenizes it (its chat
    template, its tokenizer: what its prefix cache hashes); None when it cannot say."""
    given = _given_ids(route, body)
    if given is not None:
        return given
    answer = await _tokenize(upstream, url, route, body, timeout_s)
    tokens = answer.get("tokens") if answer is not None else None
    if isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens):
        return tokens
    return None


def _given_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids: counted as it is."""
    prompt = body.get("prompt") if route == "completions" else None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


async def _tokenize(
    upstream: Upstream, url: str, route: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any] | None:
    """The engine's `/tokenize` answer for `body`'s prompt, or None."""
    if route == "completions":
        if not isinstance(body.get("prompt"), str):
            return None
        query = {k: body[k] for k in _COMPLETION_FIELDS if k in body}
    else:
        query = {k: body[k] for k in _CHAT_FIELDS if k in body}
        query.setdefault("add_generation_prompt", True)
    try:
        status, raw = await upstream.post_json(
            url, "/tokenize", jsoncodec.dumps(query), timeout_s=timeout_s
        )
        answer = jsoncodec.loads(raw) if status == 200 else None
    except (UpstreamError, TimeoutError, ValueError) as exc:
        log.debug("/tokenize of %s failed: %s", url, type(exc).__name__)
        return None
    return answer if isinstance(answer, dict) else None
