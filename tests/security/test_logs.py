"""Prompts, answers and secrets never reach the logs at INFO.

The package fleet logs at INFO (proxy and engines). This test drives the paths that log the
most (successful turns, streams, bad input, refused keys, an engine failing, a release) with
canary strings in prompts, then greps every process's whole log for the canaries, the API
keys, the admin key, the connector secret and the release token D handed out.
"""

from __future__ import annotations

import secrets

import httpx

from kvrelay.devtools.engines import CONNECTOR_SECRET
from tests.security.conftest import SecureFleet

MODEL = "kvrelay-sim"


def test_no_prompt_answer_or_secret_in_info_logs(secure_fleet: SecureFleet) -> None:
    fleet = secure_fleet
    canary = "canary" + secrets.token_hex(8)
    url = fleet.proxy.url
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

    logs = fleet.logs()
    assert "INFO" in logs["proxy"] and "INFO" in logs["decode"], "fleet must log at INFO"
    forbidden = {
        "prompt canary": canary,
        "answer": answer if len(answer) >= 8 else None,
        "api key a": fleet.key_a,
        "api key b": fleet.key_b,
        "admin key": fleet.admin_key,
        "metrics key": fleet.metrics_key,
        "connector secret": CONNECTOR_SECRET,
        "release token": token,
    }
    leaks = [
        f"{what} in {process} log"
        for process, text in logs.items()
        for what, value in forbidden.items()
        if value and value in text
    ]
    assert not leaks, leaks
