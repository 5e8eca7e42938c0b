"""Pass-through bodies are checked by what they are, whatever their Content-Type claims.

A JSON body labelled `multipart/*` once reached the engine unchecked (kv_transfer_params, an
unknown model, 100k-deep nesting); a real form must still pass through, its `model` field
checked and a `kv_transfer_params` field dropped; an engine's 5xx text answer reaches the
client OpenAI-shaped. Against `FakeUpstream`, which records exactly what the engine got.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, chaos_load
from tests.proxy.fake_upstream import FakeUpstream

MODEL = "kvrelay-sim"
ROUTES = '["/v1/embeddings","/tokenize","/v1/audio/transcriptions"]'
SMUGGLED = {"model": MODEL, "input": "hi", "kv_transfer_params": {"do_remote_prefill": True}}


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    upstream = FakeUpstream().start()
    try:
        yield upstream
    finally:
        upstream.stop()


@pytest.fixture
def proxy(fake: FakeUpstream, proxy_factory: ProxyFactory) -> ProxyServer:
    return proxy_factory([fake.url], [fake.url], passthrough_routes=ROUTES)


def _post(proxy: ProxyServer, path: str, content: bytes, content_type: str) -> httpx.Response:
    return httpx.post(proxy.url + path, content=content, timeout=30,
                      headers={"Content-Type": content_type})  # fmt: skip


def _error(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    assert chaos_load.is_openai_error(resp.json()), resp.text
    assert resp.json()["error"]["code"] == code, resp.text
    return str(resp.json()["error"]["message"])


@pytest.mark.parametrize(
    "content_type",
    ["multipart/form-data; boundary=zz", "MULTIPART/form-data; boundary=zz", "multipart/mixed",
     "text/plain", "application/octet-stream"],
)  # fmt: skip
def test_json_under_another_content_type_gets_the_json_checks(
    proxy: ProxyServer, fake: FakeUpstream, content_type: str
) -> None:
    resp = _post(proxy, "/v1/embeddings", json.dumps(SMUGGLED).encode(), content_type)
    assert resp.status_code == 200, resp.text
    seen = fake.seen[-1]
    sent = json.loads(seen.body)
    assert isinstance(sent.pop("cache_salt"), str)  # the tenant's, set by the proxy
    assert sent == {"model": MODEL, "input": "hi"}
    assert seen.headers["content-type"] == "application/json"


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=zz", "multipart/mixed"])
def test_json_under_multipart_is_refused_like_json(
    proxy: ProxyServer, fake: FakeUpstream, content_type: str
) -> None:
    unknown = json.dumps({"model": "no-such-model", "kv_transfer_params": {}}).encode()
    _error(_post(proxy, "/v1/embeddings", unknown, content_type), 404, "model_not_found")
    deep = b'{"model":"kvrelay-sim","input":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _error(_post(proxy, "/tokenize", deep, content_type), 400, "json_too_deep")
    _error(_post(proxy, "/tokenize", b"[1,2]", content_type), 400, "invalid_json")
    assert fake.seen == []


def _form(fields: list[tuple[str, bytes, str | None]], boundary: str = "b0undary") -> bytes:
    out = b""
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


AUDIO = bytes(range(256)) * 64 + b"\r\n--not-the-boundary\r\n{}"  # binary, with look-alikes


def test_a_real_form_passes_with_its_fields_checked(proxy: ProxyServer, fake: FakeUpstream) -> None:
    form_type = "multipart/form-data; boundary=b0undary"
    plain = _form([("file", AUDIO, "a.wav"), ("model", MODEL.encode(), None)])
    resp = _post(proxy, "/v1/audio/transcriptions", plain, form_type)
    assert resp.status_code == 200, resp.text
    assert fake.seen[-1].body == plain  # forwarded byte for byte
    assert fake.seen[-1].headers["content-type"] == form_type

    smuggled = _form([("model", MODEL.encode(), None), ("kv_transfer_params", b'{"a":1}', None),
                      ("file", AUDIO, "a.wav"), ("language", b"en", None)])  # fmt: skip
    resp = _post(proxy, "/v1/audio/transcriptions", smuggled, form_type)
    assert resp.status_code == 200, resp.text
    assert fake.seen[-1].body == _form(
        [("model", MODEL.encode(), None), ("file", AUDIO, "a.wav"), ("language", b"en", None)]
    )
    count = len(fake.seen)
    unknown = _form([("file", AUDIO, "a.wav"), ("model", b"no-such-model", None)])
    _error(_post(proxy, "/v1/audio/transcriptions", unknown, form_type), 404, "model_not_found")
    assert len(fake.seen) == count


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nx",
         "multipart/form-data; boundary=b0undary"),  # no closing boundary
        (b"garbage before any boundary", "multipart/form-data; boundary=b0undary"),
        (b"--b0undary--\r\n", "multipart/form-data"),  # no boundary parameter
    ],
)  # fmt: skip
def test_a_broken_form_is_a_shaped_400(
    proxy: ProxyServer, fake: FakeUpstream, body: bytes, content_type: str
) -> None:
    _error(_post(proxy, "/v1/audio/transcriptions", body, content_type), 400, "invalid_multipart")
    assert fake.seen == []


def test_an_engine_5xx_text_answer_reaches_the_client_shaped(
    proxy: ProxyServer, fake: FakeUpstream
) -> None:
    fake.status, fake.error_text = 500, "Internal Server Error: boom"
    resp = _post(proxy, "/v1/embeddings", json.dumps({"input": "x"}).encode(), "application/json")
    message = _error(resp, 502, "upstream_failed")
    assert "HTTP 500" in message and "boom" in message and "127.0.0.1" not in message
    assert resp.headers["x-request-id"]
