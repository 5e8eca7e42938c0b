"""The request path's JSON codec accepts and produces what the standard library does."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.proxy.base import jsoncodec


@pytest.mark.parametrize(
    "text",
    [
        '{"prompt": "hi", "max_tokens": 3}',
        '{"x": NaN, "y": Infinity}',  # orjson refuses these, json accepts them
        '{"big": 123456789012345678901234567890}',  # beyond 64 bits
        '{"s": "\\ud800"}',  # a lone surrogate escape
        '{"u": "caf\\u00e9 \\u2603"}',
    ],
)
def test_loads_accepts_what_json_accepts(text: str) -> None:
    got = jsoncodec.loads(text.encode())
    want = json.loads(text)
    assert json.dumps(got) == json.dumps(want)


@pytest.mark.parametrize("text", ["", "{", '{"a": }', "[1,]", "\xff"])
def test_loads_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        jsoncodec.loads(text.encode("latin-1"))


def test_deep_nesting_fails_like_json() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):
        jsoncodec.loads(deep)


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, None, True], "c": "caf\u00e9"},
        {"big": 2**70},
        {"s": "\ud800"},
    ],
)
def test_dumps_round_trips_through_json(value: object) -> None:
    out = jsoncodec.dumps(value)
    assert isinstance(out, bytes)
    assert b" " not in out.replace(b"caf", b"")  # compact
    assert json.loads(out) == value


def _stdlib_canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "value",
    [
        {"role": "user", "content": 'plain ASCII, quotes " and \\ and / and \n\t\x01'},
        {"role": "user", "content": "DEL \x7f in the middle"},
        {"role": "user", "content": "caf\u00e9 \u2603 \U0001f600"},  # non-ASCII: \u escapes
        {"role": "user", "content": "lone \ud800 surrogate"},
        {"zeta": "1", "Alpha": "2", "alpha": "3", "": "4"},  # key order by code point
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "n": 1.5e16}]},
        {"content": [{"type": "text", "text": "part"}], "role": "user"},
        {},
        "a bare string",
        [1, 2.5, "x"],
    ],
)
def test_canonical_is_byte_for_byte_what_json_writes(value: object) -> None:
    # Chat fingerprints hash these bytes: any difference would make every stored conversation
    # miss after an upgrade.
    assert jsoncodec.canonical(value) == _stdlib_canonical(value)


def test_canonical_matches_json_on_every_ascii_and_many_other_characters() -> None:
    for code in [*range(0x80), 0xA0, 0xFF, 0x2028, 0xFFFD, 0xD7FF, 0xE000, 0x1F600]:
        message = {"role": "user", "content": f"a{chr(code)}b"}
        assert jsoncodec.canonical(message) == _stdlib_canonical(message), hex(code)


def _read(loads: Callable[[bytes], object], raw: bytes) -> object:
    """What `loads` makes of `raw`: its value, or the kind of error it raises."""
    try:
        return ("value", repr(loads(raw)))
    except RecursionError:
        return ("error", "RecursionError")
    except ValueError:
        return ("error", "ValueError")


# Pieces of JSON and of what is not JSON; any run of them is read by the codec as by `json`.
_PIECES = [
    b"{", b"}", b"[", b"]", b",", b":", b" ", b"\n", b'"k"', b'"\\ud800"', b'"\\u00e9"',
    b'"\x01"', b'"\t"', b"\xff", b"\xef\xbb\xbf", b"0", b"7", b"-", b".", b"e", b"+",
    b"12345678901234567890123", b"18446744073709551616", b"1e400", b"NaN", b"-Infinity",
    b"true", b"null", b"nul", b"\x00",
]  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40))
def test_any_text_reads_as_json_reads_it(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    assert _read(jsoncodec.loads, raw) == _read(json.loads, raw)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(_JSON_VALUES)
def test_every_document_json_writes_reads_back_as_json_reads_it(value: object) -> None:
    raw = json.dumps(value).encode()  # NaN, Infinity and lone surrogates included
    assert _read(jsoncodec.loads, raw) == _read(json.loads, raw)


@pytest.mark.parametrize("offset", range(23))
def test_a_big_integer_anywhere_in_a_long_body_stays_exact(offset: int) -> None:
    """A number beyond 64 bits stays an exact integer wherever it sits in a long body."""
    big = 12345678901234567890123
    text = '{"pad": "' + "x" * offset + '", "n": ' + str(big) + ', "tail": "' + "y" * 300 + '"}'
    assert jsoncodec.loads(text.encode())["n"] == big
    short = text.replace(str(big), str(big)[:19])  # 19 digits
    assert jsoncodec.loads(short.encode())["n"] == int(str(big)[:19])
