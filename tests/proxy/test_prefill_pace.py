"""The pace at which the proxy sees its P compute prompt tokens (`PrefillPace`, the rate that
turns a holder's measured pin wait into tokens of work) follows the engine's own compute time:
on an enginesim P that takes 2 ms per computed prompt token (500 tokens a second), the proxy's
`kvrelay_prefill_pace_tokens_per_second` reads at most that, and not far below it (the legs'
HTTP and D's share of the turn are not P's busy time), once P has been busy over a second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.devtools import EngineFactory, EngineSim, ProxyFactory
from kvrelay.enginesim.reference import reference_chat
from tests.proxy.client import chat_body, post, reply_of

pytestmark = pytest.mark.nixl

US_PER_TOKEN = 2000.0  # P's modelled compute: 500 prompt tokens a second
PACE = "kvrelay_prefill_pace_tokens_per_second"
COMPUTED = "enginesim_prompt_tokens_computed_total"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineSim, EngineSim]]:
    factory = EngineFactory()
    try:
        p, d = factory.many(
            ("P", ["--role", "prefill", "--prefill-us-per-token", str(US_PER_TOKEN)]),
            ("D", ["--role", "decode"]),
        )
        yield p, d
    finally:
        factory.close()


def test_the_proxys_prefill_pace_is_the_engines_compute_rate(
    engines: tuple[EngineSim, EngineSim], proxy_factory: ProxyFactory
) -> None:
    p, d = engines
    proxy = proxy_factory([p], [d], ready_path="/ready")
    assert proxy.metrics().get(PACE, 0.0) == 0.0  # nothing measured yet
    before = p.metric(COMPUTED)
    for n in range(4):  # about 250 tokens each: half a second of P's compute
        messages = [{"role": "user", "content": f"Pace {n}: " + "count the tokens here. " * 50}]
        answer = reply_of(post(proxy.url, "/v1/chat/completions", chat_body(messages)))
        assert answer == reference_chat(messages, 12)
    computed = p.metric(COMPUTED) - before
    assert computed >= 800, computed  # P computed every prompt: over 1.6 s of its time
    pace = proxy.metrics().get(PACE, 0.0)
    rate = 1e6 / US_PER_TOKEN
    assert 0.6 * rate <= pace <= rate * 1.02, pace
    proxy.stop()
