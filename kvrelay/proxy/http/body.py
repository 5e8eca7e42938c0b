"""Reading a client's JSON body under limits: size, time, bytes held by all bodies, depth.

Each decoding step of a request is bounded and answers an OpenAI-shaped error naming its
setting: a body larger than `body_limit_bytes` is a 413; one that takes longer than
`body_read_timeout_s` to arrive is a 408 (and its connection is closed); a body that does not
fit in what is left of `inflight_body_bytes` (shared by every body this process is receiving
or serving) is a 503; JSON nested deeper than `json_max_depth` is a 400. The body is read into
one buffer and parsed from it, so the proxy holds it once as bytes (until parsed) and once as
objects.

Parsed, a body costs more than its bytes: `{},` is 3 bytes and an 80-byte dict. So before it is
parsed a JSON body also reserves, in the same budget, a bound on what its objects will take
(`parsed_size_bound`: counted from its raw bytes in C, no parse); one whose bound could never
fit in `inflight_body_bytes` is a 413 without being parsed. What a worker holds for bodies is
then what the budget says, however the bytes are arranged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import is_
from typing import Any

from aiohttp import web

from kvrelay.proxy.base import ProxyError, bad_request, jsoncodec
from kvrelay.proxy.config import Settings

BUDGET_EXHAUSTED = "body_budget_exhausted"
TOO_LARGE = "body_too_large"
# Refusals whose body is read and dropped before the answer (see `read_body`).
DRAINED = frozenset((BUDGET_EXHAUSTED, TOO_LARGE))
# A refused body is drained up to this many times `body_limit_bytes`: a body a few times over
# the limit is a client's mistake worth a clear 413; one far larger is not worth reading.
DRAIN_FACTOR = 4


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
                code=BUDGET_EXHAUSTED,
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
        code=TOO_LARGE,
    )


async def read_body(request: web.Request, settings: Settings, held: HeldBody) -> bytes | bytearray:
    """The raw body, read within the size, time and budget limits; a body aiohttp cannot
    decode (a `Content-Encoding` whose bytes do not inflate) is the client's 400.

    A body refused for its size (413) or for the budget (503) is drained before the answer
    goes: most clients (httpx, requests, the `openai` SDK) send the whole body before they
    read, so an answer followed by a close while they still send reaches them as a connection
    error, which the SDK retries with the same body, instead of the 413 that says not to or the
    503 that says to retry later. Draining drops each chunk as it comes (it holds nothing of
    the budget) and stops at `DRAIN_FACTOR` times `body_limit_bytes` or when the body's read
    time is up; a client still sending then gets aiohttp's short linger and the close, as a
    trickler would."""
    deadline = asyncio.get_running_loop().time() + settings.body_read_timeout_s
    try:
        return await _read_body(request, settings, held)
    except ProxyError as exc:
        if exc.code in DRAINED:
            await _drain(request, DRAIN_FACTOR * settings.body_limit_bytes, deadline)
        raise
    except web.RequestPayloadError as exc:
        raise ProxyError(
            400,
            f"the request body could not be read ({exc}); send it as its Content-Encoding "
            "says, or without one",
            code="malformed_request",
        ) from None


async def _read_body(request: web.Request, settings: Settings, held: HeldBody) -> bytes | bytearray:
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


async def _drain(request: web.Request, limit: int, deadline: float) -> None:
    """Read and drop what is left of a refused body, up to about `limit` bytes or `deadline`
    (not aiohttp's `request.release()`, which reads to the body's end with no bound)."""
    drained = 0
    try:
        async with asyncio.timeout_at(deadline):
            while drained <= limit and (chunk := await request.content.readany()):
                drained += len(chunk)
    except (TimeoutError, web.RequestPayloadError):
        pass  # the answer goes anyway; aiohttp closes a connection whose body is left unread


# What one JSON value or object key may cost once parsed, beyond the text of its strings: the
# object itself (an empty dict is 64 bytes plus 16 of the collector's header, a float 24, a
# string's header 49-73), its slot in its list or its dict's hash table (dicts over-allocate),
# with a margin. Measured with tracemalloc for the densest shapes (`{},` `[[1]],` `{"k":1},`
# unique keys, short strings, floats): at most ~78 bytes per counted byte below (one-key
# objects with unique keys).
VALUE_BYTES = 100
PARSE_OVERHEAD_BYTES = 4096


def parsed_size_bound(raw: bytes | bytearray, openings: int | None = None) -> int:
    """An upper bound on the memory the objects parsed from `raw` take, from counts in C.

    Every value or key but the first in a container follows a `,` or a `:`, so values and keys
    together are at most one more than the `,` `:` `{` `[` bytes (those inside strings make it
    an over-count, never an under-count). Text costs at most a byte per raw byte when the body
    is ASCII, and at most four otherwise (one astral character makes its string four bytes a
    character). A few KiB on top cover what a parse costs whatever the body (keys orjson
    caches, the outermost object). `openings`: the `{` and `[` bytes, when already counted
    (`opening_brackets`)."""
    if openings is None:
        openings = opening_brackets(raw)
    tokens = raw.count(b",") + raw.count(b":") + openings + 1
    text = len(raw) if raw.isascii() else 4 * len(raw)
    return PARSE_OVERHEAD_BYTES + text + VALUE_BYTES * tokens


def opening_brackets(raw: bytes | bytearray) -> int:
    """The `{` and `[` bytes of `raw`: at least its count of objects and arrays, so at least
    its nesting depth (strings may hold more)."""
    return raw.count(b"{") + raw.count(b"[")


def too_complex(bound: int, limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"the request body would take up to {bound // 2**20} MiB of memory once parsed (it is "
        f"dense in JSON values: each costs the proxy far more than its bytes), more than the "
        f"{limit // 2**20} MiB the proxy may hold for all bodies (setting inflight_body_bytes); "
        "send fewer values",
        code="body_too_complex",
    )


def parse_json_body(raw: bytes | bytearray, settings: Settings, held: HeldBody) -> dict[str, Any]:
    """`parse_json_object`, with the body's share of the budget grown to its raw bytes plus
    the bound on its parsed objects first (both are alive while it is parsed)."""
    openings = opening_brackets(raw)
    need = len(raw) + parsed_size_bound(raw, openings)
    if need > settings.inflight_body_bytes:
        raise too_complex(need, settings.inflight_body_bytes)
    held.grow_to(need)
    return parse_json_object(raw, settings.json_max_depth, openings)


def parse_json_object(
    raw: bytes | bytearray, max_depth: int, openings: int | None = None
) -> dict[str, Any]:
    """A JSON object from `raw`, refusing invalid JSON and nesting deeper than `max_depth`.
    `openings`: `opening_brackets(raw)` when counted already; at most `max_depth` spares the
    walk over the parsed value (it cannot nest deeper than that)."""
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
    if (openings is None or openings > max_depth) and nesting_exceeds(body, max_depth):
        raise too_deep(max_depth)
    return body


def too_deep(max_depth: int) -> ProxyError:
    return bad_request(
        f"the request body nests arrays and objects deeper than the proxy's limit of "
        f"{max_depth} levels (setting json_max_depth)",
        code="json_too_deep",
    )


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (the top level is 1); no recursion.

    Walked a level at a time, each level with iterators that run in C (the members of its
    dicts and lists chained, their types mapped, the dicts and lists among them picked out by
    `compress`), never a Python step per member: a level of hundreds of thousands of small
    objects costs milliseconds, not the event loop's next second."""
    dicts: list[Any] = [value] if type(value) is dict else []
    lists: list[Any] = [value] if type(value) is list else []
    depth = 1
    while dicts or lists:
        if depth > limit:
            return True
        members = list(
            chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists))
        )
        dicts = list(compress(members, map(is_, map(type, members), repeat(dict))))
        lists = list(compress(members, map(is_, map(type, members), repeat(list))))
        depth += 1
    return False


async def read_json_object(
    request: web.Request, settings: Settings, held: HeldBody
) -> dict[str, Any]:
    """Read and parse a JSON object body; the raw bytes are dropped once parsed."""
    raw = await read_body(request, settings, held)
    return parse_json_body(raw, settings, held)
