"""Fixtures of the real-vLLM suite (`make test-vllm`; needs `.venv-vllm`).

Only one vLLM P/D pair runs at a time (plus the reference server): the pairs are module-scoped,
so pytest stops one module's pair before the next module starts its own. Three pairs: kvrelay's
connector behind the proxy, stock NixlConnector, and the fault pair (failure paths). Every
server is stopped in a `finally`, even when a test or a start fails. Nothing here imports
vLLM: the main suite collects this directory (and deselects its tests by marker) with no vLLM
installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from kvrelay.devtools import ProxyFactory, ProxyServer, free_port, kv_events_args, vllm_servers
from kvrelay.devtools import tiny_model as tiny_llama
from tests.harness import wait_until
from tests.vllm.faulty_pair import faulty_pair


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama and a locally trained tokenizer (fixed seed)."""
    return tiny_llama.create_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class Reference:
    """The plain (non-disaggregated) vLLM server, started in the background once per session
    so its start overlaps the first pair's; `server()` waits for it (bounded)."""

    def __init__(self, model_dir: Path) -> None:
        self._server = vllm_servers.VLLMServer("reference", model_dir, cpu=0)
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future: Future[vllm_servers.VLLMServer] = self._pool.submit(self._server.start)

    def server(self) -> vllm_servers.VLLMServer:
        return self._future.result(timeout=vllm_servers.START_TIMEOUT_S + 60)

    def close(self) -> None:
        try:
            # A start still in progress finishes (or fails) before we stop the process.
            self._future.exception(timeout=vllm_servers.START_TIMEOUT_S + 60)
        finally:
            self._server.stop()
            self._pool.shutdown()


@pytest.fixture(scope="session")
def reference_launch(tiny_model: Path) -> Iterator[Reference]:
    ref = Reference(tiny_model)
    try:
        yield ref
    finally:
        ref.close()


class PDFleet:
    """A vLLM P and D, a kvrelay proxy in front of them, and the reference server."""

    decode_events = ""  # D's KV events, as kv_events_endpoints (where D publishes them)

    def __init__(
        self,
        prefill: vllm_servers.VLLMServer,
        decode: vllm_servers.VLLMServer,
        proxy: ProxyServer,
        reference: vllm_servers.VLLMServer,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.proxy = proxy
        self.reference = reference


def settled(server: vllm_servers.VLLMServer, name: str) -> float:
    """A counter of `server` once two reads agree (vLLM publishes its stats a moment after
    answering)."""
    seen = [server.metric(name)]

    def stable() -> bool:
        seen.append(server.metric(name))
        return seen[-1] == seen[-2]

    wait_until(stable, 10, interval=0.5, what=f"{name} to settle")
    return seen[-1]


def _fleet(
    pair: tuple[vllm_servers.VLLMServer, vllm_servers.VLLMServer],
    reference: Reference,
    warm: Callable[[vllm_servers.VLLMServer, vllm_servers.VLLMServer], None] | None = None,
    **settings: str,
) -> Iterator[PDFleet]:
    prefill, decode = pair
    proxies = ProxyFactory()
    try:
        vllm_servers.start_all(prefill, decode)
        ref = reference.server()
        if warm is not None:
            warm(prefill, decode)
        proxy = proxies(
            [prefill.url],
            [decode.url],
            ready_path="/ready",
            connector_secret=vllm_servers.CONNECTOR_SECRET,
            # A vLLM CPU API server on a loaded two-core runner can take over the 1 s default
            # to answer /health, and three such probes in a row (0.6 s apart here) take the one
            # D out of the pool: the likeliest cause of a module's requests answered 503 "no
            # decode engine is healthy" right after its proxy was ready. These suites test
            # reuse, not ejection.
            **{"probe_timeout_s": "30", **settings},
        )
        yield PDFleet(prefill, decode, proxy, ref)
    finally:
        proxies.close()
        vllm_servers.stop_all(prefill, decode)


def _used_by_a_later_module(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test of a module that runs after this one uses `fixture`."""
    items = request.session.items
    here = [i for i, item in enumerate(items) if item.module is request.module]
    return bool(here) and any(fixture in item.fixturenames for item in items[max(here) + 1 :])


class KeptFleet:
    """The kvrelay fleet, kept from one module to the next module that also uses it (the
    modules that share it run one after another), so it starts once per session."""

    def __init__(self) -> None:
        self._running: Iterator[PDFleet] | None = None
        self.fleet: PDFleet | None = None

    def get(self, start: Callable[[], Iterator[PDFleet]]) -> PDFleet:
        if self.fleet is None:
            self._running = start()
            self.fleet = next(self._running)
        return self.fleet

    def stop(self) -> None:
        running, self._running, self.fleet = self._running, None, None
        if running is not None:
            running.close()  # runs `_fleet`'s finally: the proxy and both engines stop


@pytest.fixture(scope="session")
def kept_kvrelay_fleet() -> Iterator[KeptFleet]:
    kept = KeptFleet()
    try:
        yield kept
    finally:
        kept.stop()


@pytest.fixture(scope="module")
def kvrelay_fleet(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    reference_launch: Reference,
    kept_kvrelay_fleet: KeptFleet,
) -> Iterator[PDFleet]:
    """vLLM P/D loading kvrelay's connector, and the proxy. P runs without a local prefix
    cache, as a P that did not serve the previous turn would: its history must come from D.
    Started once for consecutive modules that use it; stopped after the last of them."""

    def start() -> Iterator[PDFleet]:
        pair = vllm_servers.kvrelay_pair(tiny_model)
        # Both take a chat template in the request (a template that re-renders every turn:
        # test_kvrelay_reuse_accounting); no other test sends one.
        trust = "--trust-request-chat-template"
        pair[0].extra_args = ["--no-enable-prefix-caching", trust]
        # A small D, so that its holds for next turns can fill it (block-pressure test).
        # D reports its cache's residency (every block sampled: test_kvrelay_pd's residence
        # test counts a few evictions).
        # D publishes its KV events, followed only by the proxies of the tests that say so
        # (test_kvrelay_pd's pace test: an unheld history found in D's cache).
        events_port = free_port()
        pair[1].extra_args = [
            "--num-gpu-blocks-override", str(vllm_servers.DECODE_BLOCKS), trust,
            "--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0",
            *kv_events_args(events_port),
        ]  # fmt: skip
        fleets = _fleet(
            pair, reference_launch, side_channels=vllm_servers.side_channels_setting(*pair)
        )
        try:
            fleet = next(fleets)
            fleet.decode_events = f"{pair[1].url}=tcp://127.0.0.1:{events_port}"
            yield fleet
        finally:
            fleets.close()

    try:
        yield kept_kvrelay_fleet.get(start)
    finally:
        if not _used_by_a_later_module(request, "kvrelay_fleet"):
            kept_kvrelay_fleet.stop()


@pytest.fixture(scope="module")
def stock_fleet(tiny_model: Path, reference_launch: Reference) -> Iterator[PDFleet]:
    """vLLM P/D with stock NixlConnector, and the proxy in compatibility mode. The pair's NIXL
    connection is opened first (`warm_stock_pair`: slow on a small CPU host)."""
    yield from _fleet(
        vllm_servers.stock_pair(tiny_model), reference_launch, warm=vllm_servers.warm_stock_pair
    )


class FaultPair:
    """The fault pair, each engine's fault directory, and the reference server."""

    def __init__(
        self,
        prefill: vllm_servers.VLLMServer,
        decode: vllm_servers.VLLMServer,
        dirs: tuple[Path, Path],
        ref: vllm_servers.VLLMServer,
    ) -> None:
        self.prefill, self.decode, self.reference = prefill, decode, ref
        self.faults = {prefill.name: dirs[0], decode.name: dirs[1]}

    def arm(self, server: vllm_servers.VLLMServer, stall: str) -> Path:
        """Arm a one-shot stall (`recv` or `send`) on `server`; returns its fault directory."""
        faults = self.faults[server.name]
        for leftover in (f"{stall}-stalled", f"resume-{stall}"):
            (faults / leftover).unlink(missing_ok=True)
        (faults / f"stall-{stall}").touch()
        return faults


@pytest.fixture(scope="module")
def fault_pair(
    tiny_model: Path, reference_launch: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultPair]:
    """vLLM P/D loading the stalling test connector (`faulty_pair`), no proxy."""
    dirs = (tmp_path_factory.mktemp("faults-p"), tmp_path_factory.mktemp("faults-d"))
    prefill, decode = faulty_pair(tiny_model, dirs)
    try:
        vllm_servers.start_all(prefill, decode)
        yield FaultPair(prefill, decode, dirs, reference_launch.server())
    finally:
        vllm_servers.stop_all(prefill, decode)
