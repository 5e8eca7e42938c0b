"""The proxy-bound benchmark's fake engine speaks the connector's side-channel protocol.

The fake signs and checks through `kvrelay.connector.auth`, so when the protocol changes these
tests say whether the benchmark's fake still answers the proxy's own side-channel client.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvrelay.connector.sidechannel_client import AsyncSideChannelClient, SideChannelError
from tests.harness import REPO_ROOT, ServerProcess, free_port, http_ready

SECRET = "fake-engine-test-secret"


@dataclass
class Fake:
    url: str
    side_port: int


@pytest.fixture(scope="module")
def fake_decode() -> Iterator[Fake]:
    port, side = free_port(), free_port()
    env = {
        "KVRELAY_CONNECTOR_SECRET": SECRET,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable, "-m", "bench.fake_engine",
        "--role", "decode",
        "--port", str(port),
        "--side-channel-port", str(side),
        "--engine-id", "fake-d",
    ]  # fmt: skip
    ready = http_ready(f"http://127.0.0.1:{port}/health")
    with ServerProcess(argv, ready, env=env, ready_timeout=60, name="fake-d"):
        yield Fake(f"http://127.0.0.1:{port}", side)


def _post(url: str, body: dict[str, object], request_id: str) -> bytes:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return bytes(resp.read())


async def test_stream_params_are_published_and_releasable(fake_decode: Fake) -> None:
    body = {
        "prompt": "x" * 100,
        "max_tokens": 16,
        "stream": True,
        "kv_transfer_params": {"hold_blocks": True},
    }
    stream = _post(fake_decode.url, body, "req-1")
    events = [e for e in stream.split(b"\n\n") if e]
    assert len(events) == 17 and events[-1] == b"data: [DONE]"
    assert b"kv_transfer_params" not in stream  # stock vLLM streams carry no params

    client = AsyncSideChannelClient(SECRET.encode())
    try:
        params = await client.finished("127.0.0.1", fake_decode.side_port, "req-1")
        assert params is not None
        assert params["remote_port"] == fake_decode.side_port
        assert params["remote_block_ids"] and params["release_token"]
        assert await client.finished("127.0.0.1", fake_decode.side_port, "unknown") is None
        rid, token = params["remote_request_id"], params["release_token"]
        assert await client.release("127.0.0.1", fake_decode.side_port, rid, token) is True
        assert await client.release("127.0.0.1", fake_decode.side_port, rid, token) is False
    finally:
        await client.close()


async def test_side_channel_refuses_a_wrong_secret(fake_decode: Fake) -> None:
    client = AsyncSideChannelClient(b"not-the-secret")
    try:
        with pytest.raises(SideChannelError) as info:
            await client.finished("127.0.0.1", fake_decode.side_port, "req-1")
        assert info.value.status == 401
    finally:
        await client.close()


def test_json_answer_carries_params_only_when_asked_to_hold(fake_decode: Fake) -> None:
    hold = {"prompt": "x" * 100, "max_tokens": 4, "kv_transfer_params": {"hold_blocks": True}}
    held = json.loads(_post(fake_decode.url, hold, "a"))
    assert held["choices"][0]["text"] == " a" * 4
    assert held["kv_transfer_params"]["remote_engine_id"] == "fake-d"
    plain = json.loads(_post(fake_decode.url, {"prompt": "x", "max_tokens": 4}, "b"))
    assert plain["kv_transfer_params"] is None
