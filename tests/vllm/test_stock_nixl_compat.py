"""Compatibility mode: the kvrelay proxy in front of stock vLLM P/D with vLLM's NixlConnector.

No kvrelay connector on the engines; single-turn requests must still give the plain server's
greedy output (P prefills, D reads P's blocks with stock NIXL and decodes).
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import PDFleet
from tests.vllm.test_kvrelay_pd import (
    SYSTEM,
    USER_TURNS,
    chat_body,
    completion_body,
    proxy_post,
    reference_text,
    text_of,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_stock_completion_matches_reference(stock_fleet: PDFleet) -> None:
    body = completion_body(SYSTEM + " The stock decode engine says:")
    status, out = proxy_post(stock_fleet, "/v1/completions", body)
    assert status == 200, out
    assert text_of(out) == reference_text(stock_fleet.reference, "/v1/completions", body)


def test_stock_chat_matches_reference(stock_fleet: PDFleet) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[2]}]
    body = chat_body(messages)
    status, out = proxy_post(stock_fleet, "/v1/chat/completions", body)
    assert status == 200, out
    assert text_of(out) == reference_text(stock_fleet.reference, "/v1/chat/completions", body)
