"""The request bodies' declarations (`kvrelay.proxy.http.request_bodies`) and the hand checks of
the request path (`validation.py`, and `conversation_id_from` for the id's type) give the same
verdict on every body: generated ones with each field valid or of any JSON value, and pinned
edge cases. The OpenAPI document serves the declarations' schemas."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvrelay.proxy.base import ProxyError
from kvrelay.proxy.http.openapi import openapi_document
from kvrelay.proxy.http.request_bodies import TOKEN_ID_LIMIT, adapters, request_schemas
from kvrelay.proxy.http.validation import validate_chat, validate_completion
from kvrelay.proxy.tenants import MAX_SALT_CHARS
from kvrelay.proxy.turn import conversation_id_from

_HAND = {"ChatRequest": validate_chat, "CompletionRequest": validate_completion}


def _hand_accepts(name: str, body: dict[str, Any]) -> bool:
    try:
        _HAND[name](body)
        conversation_id_from(None, dict(body))
    except ProxyError as exc:
        assert exc.status == 400, exc
        return False
    return True


def _declared_accepts(name: str, body: dict[str, Any]) -> bool:
    try:
        adapters()[name].validate_python(body)
    except ValidationError:
        return False
    return True


def _agree(name: str, body: dict[str, Any]) -> bool:
    declared = _declared_accepts(name, body)
    assert _hand_accepts(name, body) == declared, (name, body, declared)
    return declared


# -- generated bodies -----------------------------------------------------------------------------

_INTS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**31, TOKEN_ID_LIMIT - 1, TOKEN_ID_LIMIT, 2**70, -(2**63)]),
)
_SCALARS = st.one_of(
    st.none(), st.booleans(), _INTS, st.floats(allow_nan=False, width=32), st.text(max_size=4)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
# A conversation id as `conversation_id_from` accepts it: its further rules on a string (not
# blank, length once trimmed, the fingerprint prefix) are the declaration's description only.
_CONVERSATION_ID = st.one_of(st.none(), st.from_regex(r"\A[a-z0-9-]{1,20}\Z"), _INTS, st.booleans())
_SALT = st.one_of(
    st.text(alphabet="ab@/\\\x00 ", max_size=4),
    st.just("s" * MAX_SALT_CHARS),
    st.just("s" * (MAX_SALT_CHARS + 1)),
)
_MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.text(max_size=4), _JSON)}, optional={"content": _JSON}
    ),
    st.dictionaries(st.sampled_from(["content", "name"]), _JSON, max_size=2),
    _JSON,
)
_TOKEN = st.one_of(_INTS, st.booleans(), st.floats(allow_nan=False, width=32))
_PROMPT = st.one_of(
    st.text(max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.lists(_TOKEN, max_size=3),
    st.lists(st.lists(_TOKEN, max_size=3), max_size=3),
    st.lists(st.one_of(st.text(max_size=2), _TOKEN, st.lists(_TOKEN, max_size=2)), max_size=3),
    _JSON,
)
# Token ids just outside the rules, alone or among good ones, flat or in a batch.
_BAD_ID = st.sampled_from([TOKEN_ID_LIMIT, 2**70, -1, True, 1.0])
_ID_NEAR_MISS = st.lists(st.one_of(_BAD_ID, st.integers(0, 9)), min_size=1, max_size=3).filter(
    lambda ids: any(type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT for t in ids)
)
# Each field: values the rules accept, and values of any kind (each field's near misses too).
_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.text(max_size=4), _JSON),
    "stream": (st.one_of(st.booleans(), st.none()), _JSON),
    "stream_options": (st.one_of(st.none(), st.dictionaries(st.text(max_size=3), _JSON)), _JSON),
    "max_tokens": (st.one_of(st.integers(1, 2**70), st.none()), _JSON),
    "max_completion_tokens": (st.one_of(st.integers(1, 2**70), st.none()), _JSON),
    "n": (st.one_of(st.integers(1, 8), st.none()), _JSON),
    "cache_salt": (
        st.one_of(st.text("abc-", min_size=1, max_size=MAX_SALT_CHARS), st.none()),
        _SALT,
    ),
    "kv_transfer_params": (st.nothing(), _JSON),
    "conversation_id": (
        st.one_of(st.none(), st.from_regex(r"\A[a-z0-9-]{1,20}\Z")),
        _CONVERSATION_ID,
    ),
    "temperature": (_JSON, _JSON),  # not the proxy's: passed through
}
_MESSAGES = (
    st.lists(
        st.fixed_dictionaries({"role": st.text(max_size=4)}, optional={"content": _JSON}),
        min_size=1,
        max_size=3,
    ),
    st.one_of(st.lists(_MESSAGE, max_size=3), _JSON),
)
_TOKEN_IDS = st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), max_size=3)
_PROMPTS = (
    st.one_of(
        st.text(max_size=4),
        st.lists(st.text(max_size=3), min_size=1, max_size=3),
        st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), min_size=1, max_size=3),
        st.lists(_TOKEN_IDS, min_size=1, max_size=3),
    ),
    st.one_of(_PROMPT, _ID_NEAR_MISS, st.lists(_ID_NEAR_MISS, min_size=1, max_size=2)),
)


@st.composite
def _bodies(
    draw: st.DrawFn, required: str, values: tuple[st.SearchStrategy[Any], ...]
) -> dict[str, Any]:
    """A body the rules accept (each optional field present or not), then, in most examples,
    one field replaced by a value of any kind: each rule is met alone."""
    fields = {**_FIELDS, required: values}
    body = {required: draw(values[0])}
    for name, (valid, _) in _FIELDS.items():
        if name != "kv_transfer_params" and draw(st.booleans()):
            body[name] = draw(valid)
    if draw(st.integers(0, 4)):
        # The body's own field half the time: its rules are the most numerous.
        name = draw(st.one_of(st.just(required), st.sampled_from(sorted(fields))))
        body[name] = draw(fields[name][1])
    return body


@settings(max_examples=800, deadline=None)
@given(_bodies("messages", _MESSAGES))
def test_chat_bodies_get_the_same_verdict_from_the_declaration_and_the_checks(
    body: dict[str, Any],
) -> None:
    _agree("ChatRequest", body)


@settings(max_examples=800, deadline=None)
@given(_bodies("prompt", _PROMPTS))
def test_completion_bodies_get_the_same_verdict_from_the_declaration_and_the_checks(
    body: dict[str, Any],
) -> None:
    _agree("CompletionRequest", body)


# -- pinned ---------------------------------------------------------------------------------------

_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "accepted"),
    [
        ({}, True),
        ({"max_tokens": 2**70, "n": 1, "max_completion_tokens": None}, True),
        ({"max_tokens": 0}, False),
        ({"max_tokens": True}, False),
        ({"max_tokens": 16.0}, False),
        ({"stream": "true"}, False),
        ({"stream": None, "stream_options": None}, True),
        ({"stream_options": []}, False),
        ({"model": None}, False),
        ({"kv_transfer_params": None}, False),
        ({"cache_salt": "a/b"}, False),
        ({"cache_salt": ""}, False),
        ({"cache_salt": "team-a", "conversation_id": "c-1", "tools": [1]}, True),
        ({"conversation_id": 7}, False),
        ({"messages": []}, False),
        ({"messages": [{"content": "no role"}]}, False),
        ({"messages": [{"role": "user"}, "text"]}, False),
    ],
)
def test_pinned_chat_bodies(extra: dict[str, Any], accepted: bool) -> None:
    assert _agree("ChatRequest", {**_CHAT, **extra}) is accepted


@pytest.mark.parametrize(
    ("prompt", "accepted"),
    [
        ("text", True),
        (["a", "b"], True),
        ([1, 2, TOKEN_ID_LIMIT - 1], True),
        ([[1, 2], [], [3]], True),
        ([], False),
        ([TOKEN_ID_LIMIT], False),
        ([-1], False),
        ([True], False),
        (["a", 1], False),
        ([[1], "a"], False),
        ([[1.0]], False),
        (None, False),
    ],
)
def test_pinned_completion_prompts(prompt: Any, accepted: bool) -> None:
    assert _agree("CompletionRequest", {"prompt": prompt}) is accepted


def test_the_openapi_document_serves_the_declared_schemas() -> None:
    schemas = openapi_document()["components"]["schemas"]
    for name, schema in request_schemas().items():
        assert schemas[name] == schema
    chat = schemas["ChatRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/Message"}
    assert chat["properties"]["kv_transfer_params"]["not"] == {}
    assert {"max_completion_tokens", "n", "cache_salt"} <= set(chat["properties"])
