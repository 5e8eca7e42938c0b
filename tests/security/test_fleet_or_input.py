"""A fleet problem is not a tenant's fault, and a tenant's input is not an engine's fault.

One P and two D enginesim engines behind a proxy whose per-key breaker pauses a key after two
strikes (`tenant_failure_limit=2`), so a single wrong strike shows. A short decode blip (each D
fails its next six requests) must pause nobody, whether one key or two keys meet it, and once
the engines serve again the next request is served. A key whose input alone fails (a marker
every D fails on, while another key is served throughout) is still paused. An input that only
the prefill engine rejects, and that D then serves on its own, does not eject P.

Each test uses its own API keys, so no test inherits another's strikes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, ProxyServer, chaos_load
from tests.harness import wait_until

MODEL = "kvrelay-sim"
BLIP = 6  # requests each D fails
KEYS = ("solo", "left", "right", "victim", "poisoner", "chatter", "p-poisoner")


def _faults(engine: EngineSim, **faults: object) -> None:
    assert engine.request("/admin/faults", faults)[0] == 200


@dataclass
class KeyedFleet:
    prefill: EngineSim
    decode: list[EngineSim]
    proxy: ProxyServer
    keys: dict[str, str]
    admin_key: str

    def chat(self, who: str, content: str = "hello", max_tokens: int = 4) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens}  # fmt: skip
        return httpx.post(self.proxy.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {self.keys[who]}"})  # fmt: skip

    def backends(self) -> list[dict[str, Any]]:
        admin = {"Authorization": f"Bearer {self.admin_key}"}
        listed = httpx.get(self.proxy.url + "/admin/backends", headers=admin, timeout=10).json()
        return [b for role in listed.values() for b in role]

    def ready(self) -> bool:
        """Every engine in its pool (a blip may have ejected some for a moment)."""
        return all(b["healthy"] for b in self.backends())

    def blip(self) -> None:
        for engine in self.decode:
            assert (
                engine.request("/admin/faults", {"fail_next_n": BLIP, "fail_status": 503})[0] == 200
            )

    def heal(self) -> None:
        for engine in self.decode:
            _faults(engine, fail_next_n=0)

    def serve_on_each_decode(self, who: str) -> None:
        """One request of `who` served by each D (the others drained meanwhile): every D has
        served a request since any earlier test's failures."""
        admin = {"Authorization": f"Bearer {self.admin_key}"}
        for engine in self.decode:
            others = [e for e in self.decode if e is not engine]
            for other in others:
                self.proxy.call("POST", "/admin/backends/drain",
                                {"role": "decode", "url": other.url}, headers=admin)  # fmt: skip
            try:
                assert self.chat(who).status_code == 200
            finally:
                for other in others:
                    self.proxy.call("POST", "/admin/backends", {"role": "decode", "url": other.url},
                                    headers=admin)  # fmt: skip

    def proxy_log(self) -> str:
        assert self.proxy.process is not None and self.proxy.process.log_path is not None
        return Path(self.proxy.process.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def fleet() -> Iterator[KeyedFleet]:
    engines, proxies = EngineFactory(), ProxyFactory()
    try:
        started = engines.many(
            ("FP0", ("--role", "prefill")), ("FD0", ("--role", "decode")),
            ("FD1", ("--role", "decode")),
        )  # fmt: skip
        keys = {name: f"sk-{name}-{secrets.token_hex(6)}" for name in KEYS}
        admin_key = "adm-" + secrets.token_hex(8)
        proxy = proxies(started[:1], started[1:], ready_path="/ready",
                        api_keys=",".join(keys.values()), admin_key=admin_key,
                        fingerprint_conversations="false", tenant_failure_limit="2",
                        # The production default: probes do not hide what requests see.
                        probe_interval_s="2")  # fmt: skip
        yield KeyedFleet(started[0], started[1:], proxy, keys, admin_key)
    finally:
        proxies.close()
        engines.close()


def _statuses(responses: list[httpx.Response]) -> list[tuple[int, str]]:
    out = []
    for resp in responses:
        body = resp.json()
        assert resp.status_code == 200 or chaos_load.is_openai_error(body), body
        out.append((resp.status_code, "" if resp.status_code == 200 else body["error"]["code"]))
    return out


def test_a_decode_blip_does_not_pause_the_only_key_sending(fleet: KeyedFleet) -> None:
    assert fleet.chat("solo").status_code == 200
    fleet.blip()
    try:
        during = _statuses([fleet.chat("solo") for _ in range(BLIP + 2)])
    finally:
        fleet.heal()  # a blip left over would fail the next tests
    assert not [s for s in during if s[1] == "tenant_paused"], during
    assert (502, "decode_unavailable") in during, during  # the blip was seen
    # The engines serve again: so is the key, at once.
    resp = fleet.chat("solo")
    assert resp.status_code == 200, resp.text


def test_a_decode_blip_seen_by_two_keys_pauses_neither(fleet: KeyedFleet) -> None:
    wait_until(fleet.ready, 15, what="every engine in its pool")
    assert fleet.chat("left").status_code == 200 and fleet.chat("right").status_code == 200
    fleet.blip()
    try:
        rounds = range(BLIP // 2 + 1)
        during = _statuses([fleet.chat(who) for _ in rounds for who in ("left", "right")])
    finally:
        fleet.heal()
    assert not [s for s in during if s[1] == "tenant_paused"], during
    # Once the proxy sees the engines healthy again (a blip may eject them for a moment),
    # both keys are served.
    wait_until(fleet.ready, 15, what="the decode engines back in their pool")
    for who in ("left", "right"):
        resp = fleet.chat(who)
        assert resp.status_code == 200, resp.text


def test_a_key_whose_input_alone_fails_is_still_paused(fleet: KeyedFleet) -> None:
    wait_until(fleet.ready, 15, what="every engine in its pool")
    fleet.serve_on_each_decode("chatter")
    marker = "POISON-" + secrets.token_hex(6)
    for engine in fleet.decode:
        assert (
            engine.request("/admin/faults", {"fail_marker": marker, "fail_status": 500})[0] == 200
        )
    try:
        outcomes = []
        for round_ in range(12):
            # The other key is served between the poisonous requests.
            for _ in range(2):
                assert fleet.chat("chatter", f"round {round_}").status_code == 200
            outcomes += _statuses([fleet.chat("poisoner", f"{marker} {round_}")])
            if outcomes[-1][1] == "tenant_paused":
                break
    finally:
        for engine in fleet.decode:
            _faults(engine, fail_marker="")
    assert outcomes[-1][1] == "tenant_paused", outcomes
    assert outcomes.count((502, "decode_unavailable")) == 2, outcomes  # the limit, no more
    assert all(b["healthy"] for b in fleet.backends())
    assert fleet.chat("chatter").status_code == 200


def test_input_only_prefill_rejects_does_not_eject_prefill(fleet: KeyedFleet) -> None:
    wait_until(fleet.ready, 15, what="every engine in its pool")
    marker = "P-ONLY-" + secrets.token_hex(6)
    assert (
        fleet.prefill.request("/admin/faults", {"fail_marker": marker, "fail_status": 500})[0]
        == 200
    )
    computed = fleet.prefill.metric("enginesim_prompt_tokens_computed_total")
    try:
        # P fails on the input, D prefills it itself and answers: every request is served.
        for i in range(6):
            resp = fleet.chat("p-poisoner", f"{marker} {i}")
            assert resp.status_code == 200, resp.text
    finally:
        _faults(fleet.prefill, fail_marker="")
    # P was never judged at fault: still in its pool, and the next turn goes through it.
    assert all(b["healthy"] for b in fleet.backends() if b["role"] == "prefill")
    assert f"ejected prefill engine {fleet.prefill.url}" not in fleet.proxy_log()
    assert fleet.chat("chatter", "after").status_code == 200
    assert fleet.prefill.metric("enginesim_prompt_tokens_computed_total") > computed
