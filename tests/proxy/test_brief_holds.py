"""Brief holds: a later turn whose conversation came back sooner than `hold_brief_s` has D keep
its history over D's `hold_max_fraction` for D's brief lease, where D would decline it. Units
for the conversation's pace (`HoldPayoff`), then the whole path on enginesim P and D (real
NIXL), driven with the `openai` SDK: a long conversation whose turns are sent at once has its
second turn's history kept (D's own `holds_brief` counter) and its third turn's P loads it from D
(P's own loaded-tokens counter), where with `hold_brief_s` 0 D declines it and P loads none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, wait_until
from kvrelay.proxy.fleet.hold_payoff import HoldPayoff
from tests.proxy.client import MODEL

LOADED = "enginesim_prompt_tokens_loaded_total"
BRIEF = "enginesim_connector_holds_brief"
DECLINED = "enginesim_connector_holds_over_budget"


def test_a_turn_back_sooner_than_hold_brief_s_is_held_brief() -> None:
    now = [0.0]
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, brief_s=30, clock=lambda: now[0])
    assert not holds.brief(None), "a first turn has shown no pace"
    assert holds.brief(0.5) and not holds.brief(30.0) and not holds.brief(120.0)
    # The gap comes from the hold the turn took...
    holds.made("t", ("t", "a"))
    now[0] += 2.0
    assert holds.brief(holds.taken("t", ("t", "a")))
    # ... or from a turn that ended without one (D declined it): `missed` reads it back.
    holds.unheld("t", ("t", "b"), "http://d1")
    now[0] += 45.0
    last = holds.missed("t", ("t", "b"))
    assert last == (45.0, "http://d1") and not holds.brief(last[0])
    off = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, brief_s=0, clock=lambda: now[0])
    assert not off.brief(0.0)


def test_every_turn_holding_still_keeps_the_gap_of_a_declined_hold() -> None:
    now = [0.0]
    always = HoldPayoff(min_use=0, patience_s=60, ttl_s=600, brief_s=30, clock=lambda: now[0])
    always.unheld("t", ("t", "c"), "http://d1")
    now[0] += 2.0
    assert always.missed("t", ("t", "c")) == (2.0, "http://d1")
    never = HoldPayoff(min_use=0, patience_s=60, ttl_s=600, brief_s=0, clock=lambda: now[0])
    never.unheld("t", ("t", "c"), "http://d1")
    assert never.missed("t", ("t", "c")) is None, "nothing asks for it"


# enginesim: D's pool of 1024 blocks of 16 tokens; one hold may pin 1% (10 blocks, 160 tokens).
HOLD_MAX = ("--hold-max-fraction", "0.01")
LONG_SYSTEM = "The history is long and the next turn comes at once, as in an agent's loop. " * 12


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    """P without a prefix cache (whatever history it has, it loads from D's hold) and D."""
    factory = EngineFactory()
    try:
        p, d = factory.many(
            ("P", ["--role", "prefill"]),
            ("D", ["--role", "decode", "--enable-prefix-caching", *HOLD_MAX]),
        )
        yield p, d
    finally:
        factory.close()


def _long_conversation(client: OpenAI, system: str) -> None:
    """Three turns, each sent as soon as the one before is answered."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]
    for question in ("Go on.", "And then?", None):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        if question is None:
            return
        content = answer.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": question},
        ]


def _third_turn_loaded(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory, brief_s: str, tag: str
) -> tuple[float, float, float]:
    """A long conversation through a fresh proxy: what P loaded in it (its third turn's, from
    the second's hold: the first turn's was declined, having no pace yet), and D's brief holds
    and declines over it."""
    p, d = engines
    proxy = proxy_factory([p], [d], ready_path="/ready", hold_brief_s=brief_s)
    client = OpenAI(base_url=proxy.url + "/v1", api_key="brief", max_retries=0, timeout=60)
    loaded, brief, declined = p.metric(LOADED), d.metric(BRIEF), d.metric(DECLINED)
    _long_conversation(client, f"{tag}. {LONG_SYSTEM}")
    # D decides on a hold as its request finishes, which the answer's last bytes may precede;
    # P loaded before it answered. Each of the three turns is over D's max.
    decided = lambda: d.metric(BRIEF) + d.metric(DECLINED) >= brief + declined + 3  # noqa: E731
    wait_until(decided, 10, what="D to keep or decline the long turns' holds")
    out = p.metric(LOADED) - loaded, d.metric(BRIEF) - brief, d.metric(DECLINED) - declined
    proxy.stop()
    return out


@pytest.mark.nixl
def test_a_long_history_is_held_briefly_and_read_by_the_next_turns_p(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    loaded, brief, declined = _third_turn_loaded(engines, proxy_factory, "30", "brief")
    # The first turn's hold declined (a first turn shows no pace); the second and third came
    # back at once, so D kept their histories (over 200 tokens each, over its 160-token max)...
    assert declined == 1 and brief == 2
    # ... and the third turn's P loaded the second's from there: whole blocks of it.
    assert loaded >= 192, loaded
    # Without brief holds D declines all three, and P computes every history.
    loaded, brief, declined = _third_turn_loaded(engines, proxy_factory, "0", "declined")
    assert brief == 0 and declined == 3
    assert loaded == 0
