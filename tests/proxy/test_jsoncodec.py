"""The request path's JSON codec accepts and produces what the standard library does."""

from __future__ import annotations

import json

import pytest

from kvrelay.proxy import jsoncodec


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
