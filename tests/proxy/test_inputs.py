"""Bad input and the proxy's own endpoints, over real HTTP against a real proxy process.

These need no engine: the proxy must refuse bad requests before forwarding anything, so the
fleet points at closed ports (and `/ready` reports that)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer
from tests.harness import free_port, wait_until
from tests.proxy.client import MODEL


@pytest.fixture
def lone_proxy(proxy_factory: ProxyFactory) -> ProxyServer:
    dead_p, dead_d = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    return proxy_factory([dead_p], [dead_d], body_limit_bytes="4096", admin_key="adm-key",
                         retries="0")  # fmt: skip


def _error(status: int, body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            "stream",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": 7, "prompt": "x"}, "model"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}},
            "kv_transfer_params",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "conversation_id": 12},
            "conversation_id",
        ),
    ],
)
def test_wrong_fields_get_400_naming_the_field(
    lone_proxy: ProxyServer, path: str, payload: dict[str, Any], param: str
) -> None:
    status, body, _ = lone_proxy.call("POST", path, payload)
    assert status == 400
    assert _error(status, body)["param"] == param


def test_malformed_and_oversized_bodies(lone_proxy: ProxyServer) -> None:
    status, body, headers = lone_proxy.call("POST", "/v1/chat/completions", raw=b'{"model": ')
    assert status == 400 and _error(status, body)["code"] == "invalid_json"
    assert headers["X-Request-Id"]
    status, body, _ = lone_proxy.call("POST", "/v1/completions", raw=b"[1, 2]")
    assert status == 400
    big = {"model": MODEL, "prompt": "x" * 10_000}
    status, body, _ = lone_proxy.call("POST", "/v1/completions", big)
    assert status == 413 and "body_limit_bytes" in _error(status, body)["message"]


def test_unknown_conversation_and_route(lone_proxy: ProxyServer) -> None:
    status, body, _ = lone_proxy.call("DELETE", "/v1/conversations/never-seen")
    assert status == 404 and _error(status, body)["code"] == "conversation_not_found"
    status, body, _ = lone_proxy.call("GET", "/v1/nothing-here")
    assert status == 404 and _error(status, body)
    status, body, _ = lone_proxy.call("GET", "/v1/chat/completions")
    assert status == 405 and _error(status, body)


def test_no_engine_gives_a_clear_error_and_ready_says_so(lone_proxy: ProxyServer) -> None:
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    status, body, _ = lone_proxy.call("POST", "/v1/completions", payload)
    assert status in (502, 503)
    assert "decode engine" in _error(status, body)["message"]
    assert lone_proxy.call("GET", "/health")[0] == 200
    wait_until(lambda: lone_proxy.call("GET", "/ready")[0] == 503, 10, what="/ready to be 503")
    metrics = lone_proxy.metrics()
    assert metrics['kvrelay_requests_total{outcome="upstream_error",route="completions"}'] == 1
    assert metrics['kvrelay_fallbacks_total{kind="decode_only"}'] == 1


def test_openapi_document(lone_proxy: ProxyServer) -> None:
    status, doc, _ = lone_proxy.call("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/ready",
                 "/v1/conversations/{conversation_id}", "/admin/backends"):  # fmt: skip
        assert path in doc["paths"]


def test_admin_endpoints_need_the_admin_key(lone_proxy: ProxyServer) -> None:
    assert lone_proxy.call("GET", "/admin/backends")[0] == 401
    wrong = {"Authorization": "Bearer nope"}
    assert lone_proxy.call("GET", "/admin/backends", headers=wrong)[0] == 401
    admin = {"Authorization": "Bearer adm-key"}
    status, pools, _ = lone_proxy.call("GET", "/admin/backends", headers=admin)
    assert status == 200 and len(pools["prefill"]) == 1 and len(pools["decode"]) == 1
    new = {"role": "decode", "url": "http://127.0.0.1:1"}
    assert lone_proxy.call("POST", "/admin/backends", new, headers=admin)[0] == 201
    status, info, _ = lone_proxy.call("POST", "/admin/backends/drain", new, headers=admin)
    assert status == 200 and info["draining"] is True
    bad = {"role": "middle", "url": "http://x:1"}
    assert lone_proxy.call("POST", "/admin/backends", bad, headers=admin)[0] == 400
    assert lone_proxy.call("DELETE", "/admin/backends", new, headers=admin)[0] == 200
    assert lone_proxy.call("DELETE", "/admin/backends", new, headers=admin)[0] == 404
    _, pools, _ = lone_proxy.call("GET", "/admin/backends", headers=admin)
    assert len(pools["decode"]) == 1


def test_admin_disabled_without_key(proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory([f"http://127.0.0.1:{free_port()}"], [f"http://127.0.0.1:{free_port()}"])
    assert proxy.call("GET", "/admin/backends", headers={"Authorization": "Bearer x"})[0] == 404


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "99999"], "port"),
        (["--prefill", "http://p:1"], "decode"),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--map-url", "redis://h:1?x=1"],
            "map_url",
        ),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--workers", "3"], "workers"),
    ],
)
def test_invalid_configuration_exits_naming_the_setting(args: list[str], named: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay.proxy.cli", "serve", "--env-file", "", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert named in proc.stderr
