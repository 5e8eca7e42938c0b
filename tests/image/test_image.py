"""Smoke test of the built proxy image (`make test-image`, which builds it first).

One container of the image (`KVRELAY_IMAGE`, default kvrelay:ci) runs as it would in a
cluster: read-only root, its own user, host network so it reaches a real enginesim P and D on
loopback. The tests read its health, readiness, versions and metrics, hold a two-turn
conversation (JSON, then streamed) whose second turn reuses D's KV, run the image's HEALTHCHECK
command, and last stop it with SIGTERM while a stream is in flight: the stream ends whole.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvrelay.devtools import (
    CONNECTOR_SECRET,
    EngineFactory,
    EngineSim,
    free_port,
    prometheus,
    sse,
    wait_until,
)
from kvrelay.enginesim.reference import reference_chat
from tests.image.container import Engine
from tests.proxy.client import chat_body, post, reply_of, stream, streamed_text

pytestmark = pytest.mark.image

IMAGE_ENV = "KVRELAY_IMAGE"
LONG_SYSTEM = "You are a careful assistant. Answer briefly. " * 6  # several full KV blocks
IMAGE_USER = "10001"


@dataclass
class Proxy:
    """The running container and how to reach it."""

    engine: Engine
    container: str
    image: dict[str, Any]
    port: int
    prefill: EngineSim
    decode: EngineSim

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, method: str = "GET") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.engine.inspect("container", self.container)["State"]
        return state

    def logs(self) -> str:
        return self.engine.run("logs", self.container, check=False)


def _image_name() -> str:
    return os.environ.get(IMAGE_ENV, "kvrelay:ci")


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    factory = EngineFactory()
    try:
        # A slow D (20 ms a token) so that a stream is still running when SIGTERM comes.
        p, d = factory.many(
            ("IP", ["--role", "prefill"]),
            ("ID", ["--role", "decode", "--decode-us-per-step", "20000"]),
        )
        yield p, d
    finally:
        factory.close()


@pytest.fixture(scope="module")
def proxy(engines: tuple[EngineSim, EngineSim]) -> Iterator[Proxy]:
    engine = Engine()
    image = _image_name()
    assert engine.exists(image), f"no image {image}: build it with `make test-image`"
    p, d = engines
    port = free_port()
    name = "kvrelay-smoke-" + secrets.token_hex(4)
    env = {
        "KVRELAY_HOST": "127.0.0.1",
        "KVRELAY_PREFILL": p.url,
        "KVRELAY_DECODE": d.url,
        "KVRELAY_SIDE_CHANNELS": ",".join(
            f"{e.url}=127.0.0.1:{e.side_channel_port}" for e in (p, d)
        ),
        "KVRELAY_CONNECTOR_SECRET": CONNECTOR_SECRET,
        "KVRELAY_PROBE_INTERVAL_S": "0.2",
        "KVRELAY_ROUTING_POLICY": "always_p",  # every turn takes P, so reuse shows on P
        "KVRELAY_LOG_LEVEL": "WARNING",
    }
    args = ["run", "--detach", "--name", name, "--network", "host", "--read-only"]
    if engine.name == "podman":
        args += ["--health-interval", "disable"]  # no systemd timers; the test runs the check
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    # The port as a flag, not in the env: the HEALTHCHECK must still find it.
    args += [image, "serve", "--port", str(port)]
    engine.run(*args)
    running = Proxy(engine, name, engine.inspect("image", image), port, p, d)
    try:

        def ready() -> bool:
            assert running.state()["Running"], running.logs()
            try:
                return running.get("/ready")[0] == 200
            except OSError:
                return False

        wait_until(ready, 60, what="the proxy container to be ready")
        yield running
    finally:
        engine.run("rm", "--force", name, check=False)


def test_health_ready_and_version(proxy: Proxy) -> None:
    status, body = proxy.get("/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = proxy.get("/ready")
    assert status == 200 and json.loads(body)["ready"] is True
    status, body = proxy.get("/version")
    assert status == 200
    roles = sorted(e["role"] for e in json.loads(body)["engines"])
    assert roles == ["decode", "prefill"]


def test_runs_as_its_user_on_a_read_only_root_without_build_leftovers(proxy: Proxy) -> None:
    assert proxy.engine.exec(proxy.container, "id", "-u").stdout.strip() == IMAGE_USER
    assert proxy.engine.inspect("container", proxy.container)["HostConfig"]["ReadonlyRootfs"]
    write = proxy.engine.exec(proxy.container, "touch", "/opt/kvrelay/written")
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    leftovers = proxy.engine.exec(
        proxy.container, "find", "/opt/kvrelay", "-name", "__pycache__", "-o", "-name", "*.pyc",
        "-o", "-name", "pip", "-o", "-name", "setuptools",
    )  # fmt: skip
    assert leftovers.returncode == 0 and leftovers.stdout == ""


def test_a_json_then_a_streamed_turn_reuse_decode_kv(proxy: Proxy) -> None:
    session = {"X-Session-ID": "smoke-" + secrets.token_hex(4)}
    loaded = "enginesim_prompt_tokens_loaded_total"
    loaded_before = proxy.prefill.metric(loaded)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "What is a cache?"},
    ]
    first = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages), session))
    assert first == reference_chat(messages, 12)
    assert proxy.prefill.metric(loaded) == loaded_before  # nothing to reuse yet
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": "And a block?"}]  # fmt: skip
    status, events, raw = stream(proxy.url, "/v1/chat/completions", chat_body(messages), session)
    assert status == 200, raw
    assert raw.rstrip().endswith(b"data: [DONE]") and b"kv_transfer_params" not in raw
    assert streamed_text(events, chat=True) == reference_chat(messages, 12)
    assert proxy.prefill.metric(loaded) > loaded_before, "turn 2 pulled no KV from D"
    metrics = prometheus.parse_samples(proxy.get("/metrics")[1].decode())
    assert metrics['kvrelay_reuse_total{result="hit"}'] == 1
    # Stored under the X-Session-ID: ending that conversation frees what D holds for it.
    conversation = f"/v1/conversations/{session['X-Session-ID']}"
    assert proxy.get(conversation, method="DELETE")[0] == 200
    proxy.decode.wait_idle()


def test_metrics_page(proxy: Proxy) -> None:
    status, body = proxy.get("/metrics")
    assert status == 200
    page = body.decode()
    assert "kvrelay_requests_total" in page and "_created" not in page


def test_healthcheck_asks_the_proxy(proxy: Proxy) -> None:
    config = proxy.image.get("Config", {})
    check = config.get("Healthcheck") or proxy.image.get("Healthcheck")  # docker, podman
    assert check, "the image has no HEALTHCHECK (podman keeps it only in docker format)"
    kind, *argv = check["Test"]
    assert kind == "CMD" and argv == ["kvrelay", "healthcheck"]
    ok = proxy.engine.exec(proxy.container, *argv)
    assert ok.returncode == 0, ok.stderr
    # It asks the proxy: pointed at a port nobody listens on, it fails.
    elsewhere = proxy.engine.exec(proxy.container, *argv, "--port", str(free_port()))
    assert elsewhere.returncode == 1 and "kvrelay healthcheck" in elsewhere.stderr
    if proxy.engine.name == "podman":
        assert proxy.engine.run("healthcheck", "run", proxy.container, check=False) == ""


def test_sigterm_lets_the_stream_in_flight_finish(proxy: Proxy) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about rivers."}]
    body = {**chat_body(messages, max_tokens=60), "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        proxy.engine.run("kill", "--signal", "TERM", proxy.container)
        rest = resp.read()
    finally:
        conn.close()
    raw = first + rest
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert streamed_text(sse.events(raw), chat=True) == reference_chat(messages, 60)
    wait_until(lambda: not proxy.state()["Running"], 30, what="the container to stop")
    assert proxy.state()["ExitCode"] == 0, proxy.logs()
