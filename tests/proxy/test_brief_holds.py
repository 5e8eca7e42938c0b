"""Brief holds: a tenant whose conversations answer sooner than `hold_brief_s` has D keep a
history over D's `hold_max_fraction` for D's brief lease, where D would decline it. Units for
the tenant's pace (`HoldPayoff.brief`), then the whole path on enginesim P and D (real NIXL),
driven with the `openai` SDK: after four short conversations whose next turns came at once, a
long history D would decline is kept (D's own `holds_brief` counter) and the next turn's P loads
it from D (P's own loaded-tokens counter), where with `hold_brief_s` 0 D declines it and P loads
none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory, wait_until
from kvrelay.proxy.fleet import HoldPayoff
from tests.proxy.client import MODEL

# A tenant's pace is trusted from its fourth gap on (`HoldPayoff`).
MIN_GAPS = 4
LOADED = "enginesim_prompt_tokens_loaded_total"
BRIEF = "enginesim_connector_holds_brief"
DECLINED = "enginesim_connector_holds_over_budget"


def _pace(holds: HoldPayoff, now: list[float], tenant: str, gaps: list[float]) -> None:
    """Conversations of `tenant` whose next turn took the hold `gap` seconds after it was made."""
    for i, gap in enumerate(gaps):
        key = (tenant, i, now[0])
        holds.made(tenant, key)
        now[0] += gap
        assert holds.taken(tenant, key) == pytest.approx(gap)


def test_a_tenant_answering_at_once_has_its_holds_asked_brief() -> None:
    now = [0.0]
    holds = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, brief_s=30, clock=lambda: now[0])
    assert not holds.brief("t"), "nothing known yet"
    _pace(holds, now, "t", [0.5] * (MIN_GAPS - 1))
    assert not holds.brief("t"), "too few gaps to trust"
    _pace(holds, now, "t", [0.5])
    assert holds.brief("t")
    assert not holds.brief("other"), "per tenant"
    # Its conversations slow down: once most of its recent gaps are longer, no longer brief.
    _pace(holds, now, "t", [120.0] * 5)
    assert not holds.brief("t")
    # A gap read back from a turn that ended unheld (D declined its hold) counts too.
    for i in range(20):
        holds.unheld("t", ("t", "declined", i), "http://d1")
        now[0] += 1.0
        assert holds.missed("t", ("t", "declined", i)) == (1.0, "http://d1")
    assert holds.brief("t")


def test_no_brief_holds_at_zero_and_every_turn_holding_still_learns_the_pace() -> None:
    now = [0.0]
    off = HoldPayoff(min_use=0.1, patience_s=60, ttl_s=600, brief_s=0, clock=lambda: now[0])
    _pace(off, now, "t", [0.1] * 10)
    assert not off.brief("t")
    always = HoldPayoff(min_use=0, patience_s=60, ttl_s=600, brief_s=30, clock=lambda: now[0])
    always.unheld("t", ("t", "c"), "http://d1")
    now[0] += 2.0
    assert always.missed("t", ("t", "c")) == (2.0, "http://d1")
    _pace(always, now, "t", [0.1] * (MIN_GAPS - 1))
    assert always.brief("t")


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


def _conversation(client: OpenAI, system: str, question: str) -> None:
    """Two turns, the second sent as soon as the first is answered."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    answer = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]


def _long_history_loaded(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory, brief_s: str, tag: str
) -> tuple[float, float, float]:
    """Four short conversations, then a long one, through a fresh proxy: what P loaded in the
    long one's second turn, and D's brief holds and declines over the long one."""
    p, d = engines
    proxy = proxy_factory([p], [d], ready_path="/ready", hold_brief_s=brief_s)
    client = OpenAI(base_url=proxy.url + "/v1", api_key="brief", max_retries=0, timeout=60)
    for i in range(MIN_GAPS):
        _conversation(client, f"Short {tag} {i}.", "Hi?")
    loaded, brief, declined = p.metric(LOADED), d.metric(BRIEF), d.metric(DECLINED)
    _conversation(client, f"{tag}. {LONG_SYSTEM}", "Summarise it.")
    # D decides on a hold as its request finishes, which the answer's last bytes may precede;
    # P loaded before it answered.
    # Both of its turns are over D's max.
    decided = lambda: d.metric(BRIEF) + d.metric(DECLINED) >= brief + declined + 2  # noqa: E731
    wait_until(decided, 10, what="D to keep or decline the long turns' holds")
    out = p.metric(LOADED) - loaded, d.metric(BRIEF) - brief, d.metric(DECLINED) - declined
    proxy.stop()
    return out


@pytest.mark.nixl
def test_a_long_history_is_held_briefly_and_read_by_the_next_turns_p(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    loaded, brief, declined = _long_history_loaded(engines, proxy_factory, "30", "brief")
    # D kept each turn's history (over 200 tokens, over its 160-token max) as a brief hold...
    assert brief == 2 and declined == 0
    # ... and P loaded it from there: whole blocks of it.
    assert loaded >= 160, loaded
    # Without brief holds D declines the same history, and P computes it all.
    loaded, brief, declined = _long_history_loaded(engines, proxy_factory, "0", "declined")
    assert brief == 0 and declined == 2
    assert loaded == 0
