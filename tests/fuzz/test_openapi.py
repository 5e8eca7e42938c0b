"""Schema-driven fuzzing of the proxy's HTTP API (schemathesis over its OpenAPI document).

A real proxy in front of real enginesim P and D engines receives requests generated from the
document it serves at `/openapi.json` (loaded from `kvrelay.proxy.http` at collection; a test
checks the served copy is the same), valid and invalid. Every answer must be below 500 and every 4xx
must be an OpenAI-shaped error. The engines run with a small `max_model_len` so generated
`max_tokens` values either finish quickly or are refused quickly. The example count is bounded
(about a minute in all); `KVRELAY_FUZZ_EXAMPLES` raises it for a longer hunt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from kvrelay.devtools import EngineFactory, ProxyFactory, ProxyServer, chaos_load
from kvrelay.proxy.http.openapi import openapi_document
from tests.security.rawhttp import send

EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_proxy() -> Iterator[ProxyServer]:
    engines, proxies = EngineFactory(), ProxyFactory()
    small = ("--max-model-len", "512", "--num-blocks", "64", "--lease-seconds", "5")
    try:
        prefill = engines("FP", "--role", "prefill", *small)
        decode = engines("FD", "--role", "decode", *small)
        # An admin key is configured (so the admin routes exist) but never sent: generated
        # admin calls must be refused cleanly, and cannot reconfigure the fleet under test.
        yield proxies([prefill], [decode], ready_path="/ready", admin_key="fuzz-admin-key",
                      first_byte_timeout="20", total_timeout="30")  # fmt: skip
    finally:
        proxies.close()
        engines.close()


SCHEMA = schemathesis.openapi.from_dict(openapi_document())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


def openai_shaped_4xx(ctx: Any, response: Any, case: Any) -> None:
    """Every client error is `{"error": {"message", "type", "param", "code"}}`."""
    if 400 <= response.status_code < 500:
        try:
            payload = response.json()
        except ValueError as exc:
            raise AssertionError(f"{response.status_code} with a non-JSON body") from exc
        if not chaos_load.is_openai_error(payload):
            raise AssertionError(f"{response.status_code} body is not OpenAI-shaped: {payload}")


def test_served_document_is_the_fuzzed_one(fuzz_proxy: ProxyServer) -> None:
    status, served, _ = fuzz_proxy.call("GET", "/openapi.json")
    assert status == 200 and served == openapi_document()


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_proxy_api_never_5xx_and_4xx_are_openai_shaped(
    operation: Any, fuzz_proxy: ProxyServer
) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=operation.as_strategy())
    def run(case: Any) -> None:
        response = case.call(base_url=fuzz_proxy.url, timeout=40)
        case.validate_response(response, checks=[not_a_server_error, openai_shaped_4xx])

    run()


RAW_ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("GET", "/v1/models"), ("DELETE", "/v1/conversations/x"), ("GET", "/metrics"),
              ("POST", "/admin/backends"), ("DELETE", "/admin/backends"),
              ("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("POST", "/tokenize"),
              ("POST", "/detokenize")]  # fmt: skip
_JSONISH = st.one_of(
    st.binary(max_size=300),
    st.integers(1, 3000).map(lambda n: b'{"messages":' + b"[" * n + b"]" * n + b"}"),
    st.text(max_size=200).map(
        lambda t: json.dumps({"model": "kvrelay-sim", "max_tokens": 2, "prompt": t,
                              "messages": [{"role": "user", "content": t}]}).encode()
    ),
    st.just(b'{"model":"kvrelay-sim","messages":[{"role":"user","content":"\\ud800"}]}'),
)  # fmt: skip


@pytest.mark.parametrize(("method", "path"), RAW_ROUTES, ids=[f"{m} {p}" for m, p in RAW_ROUTES])
def test_raw_bodies_and_header_bytes_never_5xx(
    method: str, path: str, fuzz_proxy: ProxyServer
) -> None:
    """Bytes no schema describes: arbitrary bodies, deep nesting, lone surrogates, and header
    values that are not UTF-8. Every answer is below 500 and every 4xx OpenAI-shaped."""

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    # Header bytes HTTP allows (visible ASCII, space, and 0x80-0xff: mostly not UTF-8);
    # control bytes are malformed HTTP, refused by the parser before any route.
    @given(
        body=_JSONISH,
        auth=st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F)),
    )
    def run(body: bytes, auth: bytes) -> None:
        headers = [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer " + auth),
                   (b"X-Admin-Key", auth), (b"X-Conversation-Id", b"c" + auth)]  # fmt: skip
        resp = send(fuzz_proxy.url, method, path, headers, body)
        assert resp.status < 500, (resp.status, resp.body[:300])
        if resp.status >= 400:
            try:
                payload = json.loads(resp.body)
            except ValueError:
                raise AssertionError((resp.status, resp.headers, resp.body[:300])) from None
            assert chaos_load.is_openai_error(payload), (resp.status, resp.body[:300])

    run()
