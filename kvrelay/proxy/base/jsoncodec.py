"""JSON on the request path: orjson, with the standard library behind it for what orjson refuses.

orjson parses and encodes several times faster than `json`, but refuses a few things `json`
accepts (NaN and Infinity, lone surrogate escapes, nesting deeper than 1024) and reads integers
beyond 64 bits as floats. Those inputs go to `json` instead (a run of 20 digits anywhere sends
the text there), so what the proxy accepts and answers does not depend on which library read it;
only the common case gets faster. Output is compact UTF-8.

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

# orjson keeps integers exact up to 2**64 - 1 (20 digits); longer ones need `json`. The scan maps
# every digit to 0 and every other byte to 1, then looks for twenty zeros in a row: two passes in
# C, several times faster than a regular expression, which tries a match at every digit. Before
# it, a look at every tenth byte: twenty digits in a row always cover two consecutive multiples
# of ten, so a body without two digits there (almost every body) needs no full scan; on a long
# chat's 25 KB that takes the check from more than orjson's whole parse to a tenth of it.
_DIGITS_TO_ZERO = bytes(0 if chr(b).isdigit() and b < 128 else 1 for b in range(256))
_TWENTY_DIGITS = bytes(20)
_TWO_DIGITS = bytes(2)
_SAMPLE_STRIDE = 10
_STR_TYPE = {str}


def _has_long_number(raw: bytes | bytearray) -> bool:
    if len(raw) < 20:
        return False
    if _TWO_DIGITS not in raw[::_SAMPLE_STRIDE].translate(_DIGITS_TO_ZERO):
        return False
    return _TWENTY_DIGITS in raw.translate(_DIGITS_TO_ZERO)


def loads(raw: bytes | bytearray | str) -> Any:
    """Parse JSON; raises ValueError (RecursionError for absurd nesting) like `json.loads`."""
    if not _has_long_number(raw.encode() if isinstance(raw, str) else raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
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
