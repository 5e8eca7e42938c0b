"""Reading a client's JSON body under limits: size, time, bytes held by all bodies, depth.

Each decoding step of a request is bounded and answers an OpenAI-shaped error naming its
setting: a body larger than `body_limit_bytes` is a 413; one that takes longer than
`body_read_timeout_s` to arrive is a 408 (and its connection is closed); a body that does not
fit in what is left of `inflight_body_bytes` (shared by every body this process is receiving
or serving) is a 503; JSON nested deeper than `json_max_depth` is a 400. The body is read into
one buffer and parsed from it, so the proxy holds it once as bytes (until parsed) and once as
objects.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvrelay.proxy.base import ProxyError, bad_request, jsoncodec
from kvrelay.proxy.config import Settings


class BodyBudget:
    """Bytes that the bodies of one worker process may hold together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, amount: int) -> bool:
        if self.used + amount > self.limit:
            return False
        self.used += amount
        return True

    def give_back(self, amount: int) -> None:
        self.used = max(0, self.used - amount)


@dataclass
class HeldBody:
    """A request's share of the budget; `release()` when the request is done."""

    budget: BodyBudget
    held: int = 0

    def grow_to(self, size: int) -> None:
        if size <= self.held:
            return
        if not self.budget.take(size - self.held):
            raise ProxyError(
                503,
                "the proxy is holding as many request bodies as it may right now (setting "
                "inflight_body_bytes); retry shortly",
                code="body_budget_exhausted",
            )
        self.held = size

    def release(self) -> None:
        self.budget.give_back(self.held)
        self.held = 0


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"the request body is larger than the proxy's limit of {limit} bytes "
        "(setting body_limit_bytes)",
        code="body_too_large",
    )


async def read_body(request: web.Request, settings: Settings, held: HeldBody) -> bytes | bytearray:
    """The raw body, read within the size, time and budget limits."""
    limit = settings.body_limit_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(limit)
    if length:
        held.grow_to(length)  # reserve up front: a body that cannot fit is refused unread
    if request.content.is_eof():
        # The whole body came with the headers (the common case): it is all buffered, so it is
        # taken at once, with nothing to wait for or time.
        whole = request.content.read_nowait()
        if len(whole) > limit:
            raise too_large(limit)
        held.grow_to(len(whole))
        return whole
    buf = bytearray()
    try:
        async with asyncio.timeout(settings.body_read_timeout_s):
            await _read_into(request, buf, limit, held)
    except TimeoutError:
        raise ProxyError(
            408,
            f"the request body did not arrive within {settings.body_read_timeout_s:g} s "
            "(setting body_read_timeout_s)",
            code="body_timeout",
        ) from None
    return buf


async def _read_into(request: web.Request, buf: bytearray, limit: int, held: HeldBody) -> None:
    while chunk := await request.content.readany():
        if len(buf) + len(chunk) > limit:
            raise too_large(limit)
        held.grow_to(len(buf) + len(chunk))
        buf += chunk


def parse_json_object(raw: bytes | bytearray, max_depth: int) -> dict[str, Any]:
    """A JSON object from `raw`, refusing invalid JSON and nesting deeper than `max_depth`."""
    try:
        body = jsoncodec.loads(raw)
    except RecursionError:
        raise too_deep(max_depth) from None
    except ValueError as exc:  # UnicodeDecodeError included
        if not raw.strip():  # asked only here: it copies the whole body
            raise bad_request(
                "the request body is empty; send a JSON object", code="empty_body"
            ) from None
        raise bad_request(
            f"the request body is not valid JSON ({exc}); send a JSON object",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if nesting_exceeds(body, max_depth):
        raise too_deep(max_depth)
    return body


def too_deep(max_depth: int) -> ProxyError:
    return bad_request(
        f"the request body nests arrays and objects deeper than the proxy's limit of "
        f"{max_depth} levels (setting json_max_depth)",
        code="json_too_deep",
    )


# What JSON values are besides arrays and objects.
_LEAF_TYPES = {str, int, float, bool, type(None)}


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (the top level is 1); no recursion.

    Walked a level at a time; a container is searched for containers only when the types of
    its members (one pass in C) include one, so a chat's messages, objects of strings, cost
    little however long their text."""
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            kinds = set(map(type, children))
            if not kinds <= _LEAF_TYPES:
                below.extend(c for c in children if isinstance(c, dict | list))
        level = below
        depth += 1
    return False


async def read_json_object(
    request: web.Request, settings: Settings, held: HeldBody
) -> dict[str, Any]:
    """Read and parse a JSON object body; the raw bytes are dropped once parsed."""
    raw = await read_body(request, settings, held)
    return parse_json_object(raw, settings.json_max_depth)
