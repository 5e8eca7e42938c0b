"""JSON on the request path: pydantic-core's reader and orjson's writer, with the standard
library behind both for what they refuse.

Reading: pydantic-core's `from_json` (jiter, in Rust) keeps integers of any size exact, reads
NaN and Infinity, lone surrogate escapes and control characters as `json` does. orjson reads
integers beyond 64 bits as floats, so it needed a scan of every body for 20-digit runs first,
and engines' answers are dense in digits (block ids, hashes): the reader alone costs less than
orjson and the scan did (a 25 KB chat body 13 us against 27, a short answer 0.8 against 1.5-3,
a 10 KB answer of 450 hashes 27 against 38). What it refuses (invalid JSON, nesting deeper
than its limit) goes to `json`, so what the proxy accepts and answers does not depend on which
library read it (tests/proxy/test_jsoncodec.py compares them). Writing: orjson, compact UTF-8.

`canonical` is the other encoding the proxy needs: sorted keys and ASCII only, byte for byte
what `json.dumps(value, sort_keys=True, separators=(",", ":"))` writes, because chat
fingerprints hash it and must not change between proxy versions. orjson writes those same
bytes for strings that are ASCII (but for DEL, escaped here), so only other values take the
slower standard-library path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import orjson
from pydantic_core import from_json

_STR_TYPE = {str}


def loads(raw: bytes | bytearray | str) -> Any:
    """Parse JSON; raises ValueError (RecursionError for absurd nesting) like `json.loads`."""
    try:
        # Keys only in the reader's string cache: a body's keys repeat across requests, its
        # values (prompts, ids, hashes) do not.
        return from_json(raw, cache_strings="keys")
    except ValueError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Compact JSON bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError: e.g. an integer beyond 64 bits
        return json.dumps(value, separators=(",", ":")).encode()


def canonical(value: Any) -> bytes:
    """Sorted keys, no spaces, non-ASCII escaped: `json.dumps(value, sort_keys=True,
    separators=(",", ":")).encode()`, at orjson's speed for a string or a flat object of
    strings (a chat message) whose text is ASCII."""
    return canonical_all((value,))[0]


def canonical_all(values: Iterable[Any]) -> list[bytes]:
    """`canonical` of each value, in one call: a long chat's fingerprints encode every
    message, and the loop here costs no call per message."""
    out: list[bytes] = []
    for value in values:
        if isinstance(value, str) or (
            isinstance(value, dict) and set(map(type, value.values())) <= _STR_TYPE
        ):
            try:
                encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
            except orjson.JSONEncodeError:  # a lone surrogate
                pass
            else:
                if encoded.isascii():  # else `json` writes \u escapes
                    # (An int operand makes `in` a memchr: several times faster than b"\x7f".)
                    out.append(encoded.replace(b"\x7f", b"\\u007f") if 0x7F in encoded else encoded)
                    continue
        out.append(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())
    return out
