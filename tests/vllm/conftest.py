"""Fixtures of the real-vLLM suite (`make test-vllm`; needs `.venv-vllm`).

Only one vLLM P/D pair runs at a time (plus the reference server): the pairs are module-scoped,
so pytest stops one module's pair before the next module starts its own. Every server is stopped
in a `finally`, even when a test or a start fails. Nothing here imports vLLM: the main suite
collects this directory (and deselects its tests by marker) with no vLLM installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy_server import ProxyFactory, ProxyServer
from tests.vllm.servers import (
    CONNECTOR_SECRET,
    VLLMServer,
    kvrelay_pair,
    side_channels_setting,
    start_all,
    stock_pair,
    stop_all,
)
from tests.vllm.tiny_model import create_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama and a locally trained tokenizer (fixed seed)."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Iterator[VLLMServer]:
    """A plain (non-disaggregated) vLLM server: the greedy output every path must match."""
    server = VLLMServer("reference", tiny_model, cpu=0)
    try:
        start_all(server)
        yield server
    finally:
        server.stop()


class PDFleet:
    """A vLLM P and D and a kvrelay proxy in front of them."""

    def __init__(self, prefill: VLLMServer, decode: VLLMServer, proxy: ProxyServer) -> None:
        self.prefill = prefill
        self.decode = decode
        self.proxy = proxy


def _fleet(pair: tuple[VLLMServer, VLLMServer], **settings: str) -> Iterator[PDFleet]:
    prefill, decode = pair
    proxies = ProxyFactory()
    try:
        start_all(prefill, decode)
        proxy = proxies(
            [prefill.url],
            [decode.url],
            ready_path="/ready",
            connector_secret=CONNECTOR_SECRET,
            **settings,
        )
        yield PDFleet(prefill, decode, proxy)
    finally:
        proxies.close()
        stop_all(prefill, decode)


@pytest.fixture(scope="module")
def kvrelay_fleet(tiny_model: Path, reference: VLLMServer) -> Iterator[PDFleet]:
    """vLLM P/D loading kvrelay's connector, and the proxy (reference server already up)."""
    pair = kvrelay_pair(tiny_model)
    yield from _fleet(pair, side_channels=side_channels_setting(*pair))


@pytest.fixture(scope="module")
def stock_fleet(tiny_model: Path, reference: VLLMServer) -> Iterator[PDFleet]:
    """vLLM P/D with stock NixlConnector, and the proxy in compatibility mode."""
    yield from _fleet(stock_pair(tiny_model))
