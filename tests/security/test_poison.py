"""One tenant's poisonous input cannot take the fleet away from the others.

Two P and two D enginesim engines fail (500) every request whose body carries a marker, the way
an engine fails on input it cannot handle. Tenant B sends such requests four at a time (and
lone surrogates, which engines refuse with 400) while tenant A chats: A must get every answer
right, `/ready` must stay 200 throughout, no engine may be ejected, and B must get shaped
errors naming no internal address, then a 429 once its key is paused. An engine that fails
every request while another serves them is still ejected: the judgement did not go blind.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer, chaos_load
from kvrelay.enginesim.reference import reference_chat
from tests.harness import wait_until

MODEL = "kvrelay-sim"
POISON_SECONDS = 12.0


@dataclass
class PoisonFleet:
    prefill: list[EngineSim]
    decode: list[EngineSim]
    proxy: ProxyServer
    key_a: str
    key_b: str
    admin_key: str

    @property
    def engines(self) -> list[EngineSim]:
        return [*self.prefill, *self.decode]

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def backends(self) -> list[dict[str, Any]]:
        listed = httpx.get(self.proxy.url + "/admin/backends",
                           headers=self.headers(self.admin_key)).json()  # fmt: skip
        return [b for role in listed.values() for b in role]

    def proxy_log(self) -> str:
        assert self.proxy.process is not None and self.proxy.process.log_path is not None
        return Path(self.proxy.process.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def poison_fleet() -> Iterator[PoisonFleet]:
    engines, proxies = EngineFactory(), ProxyFactory()
    try:
        started = engines.many(
            ("PP0", ("--role", "prefill")),
            ("PP1", ("--role", "prefill")),
            ("PD0", ("--role", "decode")),
            ("PD1", ("--role", "decode")),
        )
        key_a, key_b = "sk-a-" + secrets.token_hex(8), "sk-b-" + secrets.token_hex(8)
        admin_key = "adm-" + secrets.token_hex(8)
        proxy = proxies(started[:2], started[2:], ready_path="/ready",
                        api_keys=f"{key_a},{key_b}", admin_key=admin_key,
                        fingerprint_conversations="false",
                        # The production default: a good probe clears an engine's failure
                        # count, so the test's 0.2 s would hide a failing engine.
                        probe_interval_s="2")  # fmt: skip
        yield PoisonFleet(started[:2], started[2:], proxy, key_a, key_b, admin_key)
    finally:
        proxies.close()
        engines.close()


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    a_results: list[tuple[int, bool]] = field(default_factory=list)
    b_results: list[tuple[int, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)


def _a_loop(fleet: PoisonFleet, tally: Tally, stop: threading.Event, worker: int) -> None:
    with httpx.Client(timeout=60) as client:
        turn = 0
        while not stop.is_set():
            messages = [{"role": "user", "content": f"Tenant A worker {worker} turn {turn}."}]
            resp = client.post(
                fleet.proxy.url + "/v1/chat/completions",
                headers=fleet.headers(fleet.key_a),
                json={"model": MODEL, "messages": messages, "max_tokens": 6},
            )
            right = resp.status_code == 200 and resp.json()["choices"][0]["message"][
                "content"
            ] == reference_chat(messages, 6)
            with tally.lock:
                tally.a_results.append((resp.status_code, right))
            turn += 1  # fmt: skip


def _b_poison(fleet: PoisonFleet, tally: Tally, content: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    resp = httpx.post(fleet.proxy.url + "/v1/chat/completions", timeout=60,
                      headers=fleet.headers(fleet.key_b),
                      content=json.dumps(body).encode())  # fmt: skip
    with tally.lock:
        tally.b_results.append((resp.status_code, resp.json(), dict(resp.headers)))


def _ready_loop(fleet: PoisonFleet, tally: Tally, stop: threading.Event) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            code = client.get(fleet.proxy.url + "/ready").status_code
            with tally.lock:
                tally.ready.append(code)
            stop.wait(0.1)


def test_poisoning_tenant_leaves_the_other_tenant_the_whole_fleet(
    poison_fleet: PoisonFleet,
) -> None:
    fleet = poison_fleet
    marker = "POISON-" + secrets.token_hex(6)
    for engine in fleet.engines:
        assert engine.request("/admin/faults", {"fail_marker": marker})[0] == 200
    tally, stop = Tally(), threading.Event()
    background = [threading.Thread(target=_a_loop, args=(fleet, tally, stop, i)) for i in (0, 1)]
    background.append(threading.Thread(target=_ready_loop, args=(fleet, tally, stop)))
    for thread in background:
        thread.start()
    try:
        deadline = time.monotonic() + POISON_SECONDS
        with ThreadPoolExecutor(max_workers=4) as pool:
            rounds = 0
            while time.monotonic() < deadline:
                # Four at a time: marker requests every engine fails, and lone surrogates.
                poisons = [f"{marker} round {rounds}"] * 3 + ["\ud800"]
                list(pool.map(lambda c: _b_poison(fleet, tally, c), poisons))
                rounds += 1
    finally:
        stop.set()
        for thread in background:
            thread.join(60)
        for engine in fleet.engines:
            engine.request("/admin/faults", {"fail_marker": ""})

    # Tenant A: every request answered, and answered right.
    assert len(tally.a_results) >= 10, tally.a_results
    assert all(status == 200 and right for status, right in tally.a_results), [
        r for r in tally.a_results if r != (200, True)
    ]
    # The fleet stayed ready on every check, and no engine was ever ejected.
    assert tally.ready and set(tally.ready) == {200}, tally.ready
    assert all(b["healthy"] for b in fleet.backends())
    assert "ejected" not in fleet.proxy_log()
    # Tenant B: shaped errors for itself alone, naming no engine address; then paused.
    statuses = {status for status, _, _ in tally.b_results}
    assert statuses <= {400, 429, 502}, statuses
    for status, body, headers in tally.b_results:
        assert chaos_load.is_openai_error(body), body
        assert "127.0.0.1" not in body["error"]["message"], body
        if status == 502:
            assert "decode-" in body["error"]["message"], body
        if status == 429:
            assert body["error"]["code"] == "tenant_paused" and int(headers["retry-after"]) >= 1
    assert 502 in statuses and 429 in statuses, statuses
    # A paused key is paused for everything, its clean requests too; A is not.
    clean = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    paused = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=clean,
                        headers=fleet.headers(fleet.key_b), timeout=30)  # fmt: skip
    assert paused.status_code == 429 and chaos_load.is_openai_error(paused.json())
    served = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=clean,
                        headers=fleet.headers(fleet.key_a), timeout=30)  # fmt: skip
    assert served.status_code == 200, served.text


def test_an_engine_failing_every_request_is_still_ejected(poison_fleet: PoisonFleet) -> None:
    fleet = poison_fleet
    broken = fleet.decode[0]
    assert broken.request("/admin/faults", {"fail_next_n": 1000, "fail_status": 500})[0] == 200
    try:

        def ejected() -> bool:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 2}  # fmt: skip
            resp = httpx.post(fleet.proxy.url + "/v1/chat/completions", json=body, timeout=30,
                              headers=fleet.headers(fleet.key_a))  # fmt: skip
            assert resp.status_code == 200, resp.text  # the other D serves every request
            return f"ejected decode engine {broken.url}" in fleet.proxy_log()

        wait_until(ejected, 30, interval=0.05, what="the failing decode engine to be ejected")
    finally:
        broken.request("/admin/faults", {"fail_next_n": 0})
    # Its probes are fine, so it comes back.
    wait_until(lambda: all(b["healthy"] for b in fleet.backends()), 15, what="readmission")
