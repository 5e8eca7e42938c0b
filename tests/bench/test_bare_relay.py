"""The proxy-bound benchmark's bare relay does a P→D turn end to end on the fake engines."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.bench.helpers import fake_engine, start
from tests.harness import free_port


@pytest.fixture(scope="module")
def relay_url() -> Iterator[str]:
    p_argv, p_url, _ = fake_engine("prefill")
    d_argv, d_url, _ = fake_engine("decode")
    port = free_port()
    relay_argv = [
        sys.executable, "-m", "bench.bare_relay", "--port", str(port),
        "--prefill", p_url, "--decode", d_url,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with (
        start(p_argv, p_url + "/health", "fake-p"),
        start(d_argv, d_url + "/health", "fake-d"),
        start(relay_argv, url + "/ready", "bare-relay"),
    ):
        yield url


def _post(url: str, path: str, body: dict[str, object]) -> bytes:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return bytes(resp.read())


def test_json_turn_comes_back_without_the_engines_params(relay_url: str) -> None:
    answer = json.loads(_post(relay_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}))
    assert answer["choices"][0]["text"] == " a" * 4
    assert "kv_transfer_params" not in answer


def test_streamed_chat_turn_passes_through_to_done(relay_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    events = [e for e in _post(relay_url, "/v1/chat/completions", body).split(b"\n\n") if e]
    assert len(events) == 4 and events[-1] == b"data: [DONE]"
