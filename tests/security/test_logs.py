"""Prompts, answers and secrets never reach the logs, at INFO in text or at DEBUG in JSON.

The package fleet logs at INFO (proxy and engines); a second proxy logs JSON at DEBUG. The tests
drive the paths that log the most (successful turns, streams, bad input, refused keys, an engine
failing, a release) with canary strings in prompts, then grep every process's whole log for the
canaries, the API keys, the admin key, the connector secret and the release token D handed out.
The JSON test also checks the shape of every line and of the per-turn summaries.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx

from kvrelay.devtools import CONNECTOR_SECRET, ProxyFactory
from tests.security.conftest import SecureFleet

MODEL = "kvrelay-sim"
LEASE_BOUND_S = 45.0  # the fleet's engines hold blocks at most 30 s (--lease-seconds)


def _drive_chatty_paths(fleet: SecureFleet, url: str) -> dict[str, str | None]:
    """Run through the proxy at `url` the paths that log the most, with canaries in the
    prompts; returns what must appear in no log line (name -> value)."""
    canary = "canary" + secrets.token_hex(8)
    messages = [{"role": "system", "content": f"Secret system prompt {canary}. " * 4},
                {"role": "user", "content": f"My password is {canary}-pw"}]  # fmt: skip
    # Ids are not secrets (they may be logged): keep the canary out of them.
    conv, request_id = "logs-" + secrets.token_hex(4), "req-" + secrets.token_hex(6)
    headers = {**fleet.a, "X-Conversation-Id": conv, "X-Request-Id": request_id}
    resp = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 8})  # fmt: skip
    assert resp.status_code == 200
    answer = resp.json()["choices"][0]["message"]["content"]
    # The release token D handed out for this turn (a capability: must not be logged).
    entry = fleet.entry(fleet.key_a, conv)
    assert entry is not None and entry.release_token is not None
    token = entry.release_token

    follow = [*messages, {"role": "assistant", "content": answer},
              {"role": "user", "content": f"Again {canary}-2"}]  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": follow, "max_tokens": 8,
                            "stream": True}) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        streamed.read()
    # Paths that log warnings: bad input, refused keys, an engine failing a request.
    httpx.post(url + "/v1/chat/completions", headers=fleet.a, content=f'{{"{canary}": ')
    httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {canary}-key"},
               json={"model": MODEL, "messages": messages})  # fmt: skip
    httpx.get(url + "/admin/backends", headers={"Authorization": f"Bearer {canary}-adm"})
    assert fleet.decode.request("/admin/faults", {"fail_next_n": 1})[0] == 200
    failed = httpx.post(url + "/v1/chat/completions", headers=fleet.b, timeout=60,
                        json={"model": MODEL, "messages": messages, "max_tokens": 4})  # fmt: skip
    assert failed.status_code >= 500 and "error" in failed.json()
    ended = httpx.delete(f"{url}/v1/conversations/{conv}", headers=fleet.a)
    assert ended.status_code == 200
    return {
        "prompt canary": canary,
        "answer": answer if len(answer) >= 8 else None,
        "api key a": fleet.key_a,
        "api key b": fleet.key_b,
        "admin key": fleet.admin_key,
        "metrics key": fleet.metrics_key,
        "connector secret": CONNECTOR_SECRET,
        "release token": token,
    }


def _leaks(logs: dict[str, str], forbidden: dict[str, str | None]) -> list[str]:
    return [
        f"{what} in {process} log"
        for process, text in logs.items()
        for what, value in forbidden.items()
        if value and value in text
    ]


def test_no_prompt_answer_or_secret_in_info_logs(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    forbidden = _drive_chatty_paths(fleet, fleet.proxy.url)
    logs = fleet.logs()
    assert "INFO" in logs["proxy"] and "INFO" in logs["decode"], "fleet must log at INFO"
    leaks = _leaks(logs, forbidden)
    assert not leaks, leaks


def test_no_prompt_answer_or_secret_in_json_debug_logs(
    secure_fleet: SecureFleet, proxy_factory: ProxyFactory
) -> None:
    """A second proxy on the same engines and map, logging JSON at DEBUG (the most it says):
    every line is one JSON object, each turn has its summary, and nothing secret appears."""
    fleet = secure_fleet
    # Bounded by the engines' 30 s lease: what a slow release (a loaded machine) leaves held
    # is freed by then, so the engines are idle whatever the previous test left.
    fleet.wait_clean(LEASE_BOUND_S)
    proxy = proxy_factory(
        [fleet.prefill], [fleet.decode], ready_path="/ready",
        api_keys=f"{fleet.key_a},{fleet.key_b}", admin_key=fleet.admin_key,
        metrics_key=fleet.metrics_key, map_url=fleet.redis.url,
        log_level="DEBUG", log_format="json",
    )  # fmt: skip
    forbidden = _drive_chatty_paths(fleet, proxy.url)
    fleet.wait_clean(LEASE_BOUND_S)  # every release done (and logged) before the logs are read
    assert proxy.process is not None and proxy.process.log_path is not None
    text = Path(proxy.process.log_path).read_text(errors="replace")
    leaks = _leaks({"json proxy": text, **fleet.logs()}, forbidden)
    assert not leaks, leaks

    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert lines and all(isinstance(line, dict) for line in lines)
    for line in lines:
        assert {"time", "level", "logger", "message", "process"} <= set(line), line
    assert any(line["level"] == "DEBUG" for line in lines), "the proxy must log at DEBUG"
    turns = [line for line in lines if line["logger"] == "kvrelay.turn"]
    # Two turns of tenant a, the refused ones (bad JSON, bad key) never became turns, and
    # tenant b's turn that D failed.
    assert [t["status"] for t in turns] == [200, 200, 502], turns
    first, second, failed = turns
    for turn in turns:
        assert turn["level"] == "INFO" and turn["message"] == "turn"
        assert turn["tenant"].startswith("t") and turn["route"] == "chat"
        assert set(turn["duration_ms"]) == {"total", "prefill", "decode_ttfb", "decode"}
        assert turn["duration_ms"]["total"] > 0
        assert turn["prefill"]["engine"] == fleet.prefill.url
    assert first["request_id"].startswith("req-")
    assert first["conversation"] == second["conversation"] and len(first["conversation"]) == 16
    assert first["stored_as"] == first["conversation"]
    assert (first["lookup"], second["lookup"]) == ("miss", "hit")
    assert second["tokens_offered"] > 0 and second["stream"] is True
    # What P reported it reused (its connector loaded the held history), not the offer.
    assert second["tokens_reused"] == second["prefill"]["prompt"]["reused_tokens"] > 0
    assert first["tokens_reused"] == 0 and second["prefilled_by"] == "prefill"
    for turn in (first, second):
        decode = {k: v for k, v in turn["decode"].items() if k != "prompt"}
        assert decode == {"engine": fleet.decode.url, "status": 200, "attempts": 1}
        assert turn["retries"] == 0 and turn["error"] is None
        assert 0 < turn["duration_ms"]["decode_ttfb"] <= turn["duration_ms"]["total"]
    assert failed["tenant"] != first["tenant"]
    assert failed["error"] == "ProxyError" and failed["decode"]["status"] == 500
