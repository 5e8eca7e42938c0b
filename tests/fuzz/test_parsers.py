"""Property-based fuzzing (hypothesis) of everything that parses input from a network peer.

- the proxy's SSE relay filter (engine bytes → client bytes, params captured and stripped);
- `kv_transfer_params` handling: clients' are refused and never forwarded, engines' are parsed
  without crashing, whatever they contain;
- `KVEntry` validation and its stored form;
- the side-channel message parser and HMAC verification;
- conversation fingerprints: distinct histories never share one, and "extends" holds exactly
  for strict prefixes.

Each property raises only the documented error type on bad input; nothing else escapes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvrelay.connector.auth import AuthFailure, sign_headers, verify
from kvrelay.connector.protocol import (
    KV_TRANSFER_PARAMS,
    ClaimRequest,
    HandshakeResponse,
    KVTransferParams,
    ReleaseRequest,
)
from kvrelay.kvcache_map import ConversationKey, KVEntry
from kvrelay.kvcache_map._entry import decode_key, encode_key
from kvrelay.kvcache_map._errors import EntryDecodeError, InvalidKeyError
from kvrelay.proxy.base import ProxyError, jsoncodec, upstream_error_from_body
from kvrelay.proxy.http.validation import validate_chat, validate_completion
from kvrelay.proxy.turn import chat_shape, completion_shape
from kvrelay.proxy.turn.conversation import chained_fingerprints
from kvrelay.proxy.turn.legs import decode_body, prefill_body
from kvrelay.proxy.turn.streaming import SSEFilter

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
PARAM_FIELDS = [
    "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size",
    "remote_blocks_expiry_time", "remote_block_hashes", "release_token", "hold_blocks",
    "remote_url",
]  # fmt: skip
engine_params = st.dictionaries(
    st.sampled_from(PARAM_FIELDS) | st.text(max_size=10), json_values, max_size=10
)


# -- SSE ----------------------------------------------------------------------------------------

content_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=20)


@st.composite
def sse_streams(draw: st.DrawFn) -> tuple[list[bytes], dict[str, Any] | None]:
    """A chat stream as an engine sends it: chunks, maybe one params event, maybe [DONE]."""
    events: list[bytes] = []
    for i in range(draw(st.integers(0, 6))):
        chunk = {"id": f"c{i}", "choices": [{"index": 0, "delta": {"content": draw(content_text)}}]}
        events.append(b"data: " + json.dumps(chunk).encode())
    if draw(st.booleans()):
        events.insert(draw(st.integers(0, len(events))), b": keep-alive comment")
    params = None
    if draw(st.booleans()):
        params = draw(engine_params)
        last = {"id": "last", "choices": [], "kv_transfer_params": params}
        events.append(b"data: " + json.dumps(last).encode())
    if draw(st.booleans()):
        events.append(b"data: [DONE]")
    return events, params


@FUZZ
@given(sse_streams(), st.data())
def test_sse_filter_strips_params_and_keeps_every_other_byte(
    stream: tuple[list[bytes], dict[str, Any] | None], data: st.DataObject
) -> None:
    events, params = stream
    raw = b"".join(e + b"\n\n" for e in events)
    # Split the bytes anywhere, as TCP does.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    sse = SSEFilter()
    out = b"".join(sse.feed(p) for p in pieces) + sse.flush()
    assert b"kv_transfer_params" not in out
    assert sse.params == params
    assert sse.saw_done == (b"data: [DONE]" in events)
    # Events without params pass byte for byte, in order; the params event keeps its other
    # fields (re-encoded).
    plain = [e for e in events if b"kv_transfer_params" not in e]
    got = [e for e in out.split(b"\n\n") if e]
    if params is None:
        assert got == plain
    else:
        assert [e for e in got if not e.startswith(b'data: {"id":"last"')] == plain
        assert b'data: {"id":"last","choices":[]}' in got


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_sse_filter_never_raises_on_arbitrary_bytes(chunks: list[bytes]) -> None:
    sse = SSEFilter()
    out = b"".join(sse.feed(c) for c in chunks) + sse.flush()
    assert isinstance(out, bytes)
    assert sse.params is None or isinstance(sse.params, dict)


# -- kv_transfer_params -------------------------------------------------------------------------

client_bodies = st.dictionaries(st.text(max_size=12), json_values, max_size=6)


@FUZZ
@given(client_bodies, engine_params)
def test_client_kv_transfer_params_are_refused_and_never_forwarded(
    body: dict[str, Any], params: dict[str, Any]
) -> None:
    chat = {**body, "model": "m", "messages": [{"role": "user", "content": "x"}]}
    completion = {**body, "model": "m", "prompt": "x"}
    for validate, request in ((validate_chat, chat), (validate_completion, completion)):
        request[KV_TRANSFER_PARAMS] = params
        try:
            validate(request)
        except ProxyError as exc:
            assert exc.status == 400
        else:
            raise AssertionError("client kv_transfer_params were accepted")
    # Even if a body carrying them reached the leg builders, only proxy-made params go out.
    smuggled = {**chat, KV_TRANSFER_PARAMS: params}
    p_body = prefill_body(smuggled, None)
    assert p_body[KV_TRANSFER_PARAMS] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    assert KV_TRANSFER_PARAMS not in decode_body(smuggled, None, None, hold=False)
    assert decode_body(smuggled, None, None, hold=True)[KV_TRANSFER_PARAMS] == {"hold_blocks": True}


@FUZZ
@given(engine_params)
def test_engine_params_parse_or_fail_cleanly(params: dict[str, Any]) -> None:
    try:
        parsed = KVTransferParams.from_wire(params)
    except ValidationError:
        parsed = None
    if parsed is not None:
        again = KVTransferParams.from_wire(parsed.to_wire())
        assert again is not None and again.to_wire() == parsed.to_wire()
    try:
        entry = KVEntry.from_kv_transfer_params(params, url="http://d:1", fingerprint="m:1:x")
    except ValueError:
        return
    # An accepted entry is safe to replay: it round-trips and points where the params said.
    assert entry.url == "http://d:1"
    assert entry.host == params["remote_host"] and entry.port == params["remote_port"]
    assert KVEntry.from_bytes(entry.to_bytes()) == entry
    replay = entry.to_kv_transfer_params().to_wire()
    assert replay["remote_url"] == "http://d:1" and replay["do_remote_decode"] is True


@FUZZ
@given(
    st.integers(100, 599),
    st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()),
)
def test_engine_error_bodies_become_clear_errors(status: int, raw: bytes) -> None:  # fmt: skip
    err = upstream_error_from_body(status, raw, "decode")
    body = err.body()["error"]
    assert err.status == status and isinstance(body["message"], str) and body["message"]
    assert body["param"] is None or isinstance(body["param"], str)
    assert body["code"] is None or isinstance(body["code"], str)
    json.dumps(err.body())  # always serialisable


# -- KVEntry ------------------------------------------------------------------------------------

entry_fields = st.fixed_dictionaries(
    {},
    optional={
        "engine_id": json_values, "host": json_values, "port": json_values, "url": json_values,
        "request_id": json_values, "block_ids": json_values, "num_tokens": json_values,
        "block_hashes": json_values, "fingerprint": json_values, "expires_at": json_values,
        "release_token": json_values, "tp_size": json_values,
    },
)  # fmt: skip


@FUZZ
@given(entry_fields)
def test_kventry_validation_accepts_only_sane_entries(fields: dict[str, Any]) -> None:
    try:
        entry = KVEntry.model_validate(fields)
    except ValidationError:
        return
    assert 1 <= entry.port <= 65535 and entry.num_tokens >= 1
    assert math.isfinite(entry.expires_at) and entry.expires_at > 0
    assert all(b >= 0 for group in entry.block_ids for b in group) and any(entry.block_ids)
    assert max(len(g) for g in entry.block_ids) <= entry.num_tokens
    assert entry.url.startswith(("http://", "https://"))
    assert KVEntry.from_bytes(entry.to_bytes()) == entry


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_kventry_from_bytes_raises_only_decode_errors(raw: bytes) -> None:
    with contextlib.suppress(EntryDecodeError):
        KVEntry.from_bytes(raw)


@FUZZ
@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40), st.text(max_size=40))
def test_conversation_keys_encode_injectively(t1: str, c1: str, t2: str, c2: str) -> None:
    keys = []
    for tenant, conv in ((t1, c1), (t2, c2)):
        try:
            keys.append((ConversationKey(tenant, conv), encode_key(ConversationKey(tenant, conv))))
        except InvalidKeyError:
            return
    (k1, e1), (k2, e2) = keys
    assert decode_key(e1) == k1 and decode_key(e2) == k2
    assert (e1 == e2) == (k1 == k2)
    assert all(ch.isalnum() or ch in "-_." for ch in e1)


# -- the side channel ---------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_side_channel_messages_parse_or_raise_validation_error(raw: bytes) -> None:
    for model in (ClaimRequest, ReleaseRequest, HandshakeResponse):
        try:
            msg = model.model_validate_json(raw)
        except ValidationError:
            continue
        if isinstance(msg, ClaimRequest | ReleaseRequest):
            assert 1 <= len(msg.request_id) <= 512


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["X-KVRelay-Timestamp", "X-KVRelay-Signature", "Other"]),
        st.text(max_size=70),
        max_size=3,
    ),
    st.sampled_from(["GET", "POST"]),
    st.text(max_size=30),
    st.binary(max_size=100),
)
def test_forged_side_channel_headers_are_refused(
    headers: dict[str, str], method: str, path: str, body: bytes
) -> None:
    secret = b"fuzz-secret"
    own = frozenset({"10.0.0.1:7000"})
    assert verify(secret, headers, method, path, body, destinations=own) is not None
    # A correctly signed request verifies; flipping any input breaks it.
    good = sign_headers(secret, method, path, body, dest="10.0.0.1:7000")

    def check(key: bytes, p: str, b: bytes) -> AuthFailure | None:
        return verify(key, good, method, p, b, destinations=own)

    assert check(secret, path, body) is None
    assert check(secret, path, body + b"x") is AuthFailure.BAD_SIGNATURE
    assert check(secret, path + "x", body) is AuthFailure.BAD_SIGNATURE
    assert check(b"other", path, body) is AuthFailure.BAD_SIGNATURE
    other = frozenset({"10.0.0.2:7000"})
    assert verify(secret, good, method, path, body, destinations=other) is not None


# -- conversation fingerprints ------------------------------------------------------------------

messages_st = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": content_text}
    ),
    min_size=1,
    max_size=6,
)


@FUZZ
@given(messages_st, messages_st)
def test_distinct_histories_have_distinct_fingerprints(a: list[Any], b: list[Any]) -> None:
    assume(a != b)
    assert chained_fingerprints(a)[-1] != chained_fingerprints(b)[-1]
    body_a, body_b = {"model": "m", "messages": a}, {"model": "m", "messages": b}
    assert chat_shape(body_a).store_fingerprint != chat_shape(body_b).store_fingerprint
    # The same history under another model (another prompt template) is another conversation.
    other_model = chat_shape({"model": "m2", "messages": a}).store_fingerprint
    assert other_model != chat_shape(body_a).store_fingerprint


@FUZZ
@given(messages_st, messages_st)
def test_extends_holds_exactly_for_strict_prefixes(a: list[Any], b: list[Any]) -> None:
    stored = chat_shape({"model": "m", "messages": a}).store_fingerprint
    assert stored is not None
    is_strict_prefix = len(a) < len(b) and b[: len(a)] == a
    assert chat_shape({"model": "m", "messages": b}).extends(stored) == is_strict_prefix
    # Text and token prompts: the same rule on characters and token ids.
    ta, tb = "".join(m["content"] for m in a), "".join(m["content"] for m in b)
    text_stored = completion_shape({"prompt": ta}).store_fingerprint
    assert text_stored is not None
    text_prefix = len(ta) < len(tb) and tb.startswith(ta)
    assert completion_shape({"prompt": tb}).extends(text_stored) == text_prefix


@FUZZ
@given(st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
       st.lists(st.integers(0, 2**31), min_size=1, max_size=20))  # fmt: skip
def test_token_prompt_prefixes_detected_exactly(a: list[int], b: list[int]) -> None:
    stored = completion_shape({"prompt": a}).store_fingerprint
    assert stored is not None
    expected = len(a) < len(b) and b[: len(a)] == a
    assert completion_shape({"prompt": b}).extends(stored) == expected
    # A stored fingerprint of one kind never matches a prompt of another kind.
    assert not chat_shape({"messages": [{"role": "user", "content": str(b)}]}).extends(stored)


_PROMPT_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
field_value = st.one_of(
    st.none(), st.text(max_size=30), st.integers(), st.lists(st.text(max_size=5), max_size=2)
)
any_message = st.one_of(
    st.dictionaries(st.sampled_from([*_PROMPT_FIELDS, "id", "refusal"]), field_value, max_size=5),
    st.text(max_size=10),
)


def _fingerprints_by_definition(messages: list[Any], context: bytes) -> list[str]:
    """The chain as `kvrelay.proxy.turn.conversation` defines it, with the standard library only."""
    h = hashlib.sha256(b"kvrelay-msgs-v1\n" + context).digest()
    out = [h.hex()[:32]]
    for msg in messages:
        if isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if k in _PROMPT_FIELDS and v is not None}
        encoded = json.dumps(msg, sort_keys=True, separators=(",", ":")).encode()
        h = hashlib.sha256(h + encoded).digest()
        out.append(h.hex()[:32])
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_message, max_size=6), st.binary(max_size=8))
def test_fingerprints_follow_their_definition(messages: list[Any], context: bytes) -> None:
    """Stored conversations keep matching across versions only while every shortcut in the
    fingerprint code writes the bytes of the definition."""
    assert chained_fingerprints(messages, context) == _fingerprints_by_definition(messages, context)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=8), st.text(max_size=40), max_size=6))
def test_canonical_json_equals_the_standard_library(message: dict[str, str]) -> None:
    expected = json.dumps(message, sort_keys=True, separators=(",", ":")).encode()
    assert jsoncodec.canonical(message) == expected
