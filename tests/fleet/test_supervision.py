"""`--workers N` supervision: a worker killed under load is replaced, the port keeps answering,
`/metrics` stays consistent, and SIGTERM to the parent still drains every worker."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvrelay.devtools import EngineSim, ProxyFactory, ProxyServer
from tests.fleet.workers import Load, worker_inflight, worker_pids
from tests.harness import RedisServer, wait_until

WORKERS = 2


def _multiworker_proxy(
    proxy_factory: ProxyFactory, pd: tuple[EngineSim, EngineSim], redis: RedisServer
) -> ProxyServer:
    prefill, decode = pd
    proxy = proxy_factory(
        [prefill], [decode], ready_path="/ready", workers=str(WORKERS), map_url=redis.url,
        log_level="INFO",
    )  # fmt: skip
    assert proxy.process is not None and proxy.process.proc is not None
    parent = proxy.process.proc.pid
    wait_until(lambda: len(worker_pids(parent)) == WORKERS, 30, what="both workers up")
    return proxy


def _inflight_total(proxy: ProxyServer) -> float:
    return sum(v for k, v in proxy.metrics().items() if k.startswith("kvrelay_inflight_requests"))


def _requests_total(proxy: ProxyServer) -> float:
    return sum(v for k, v in proxy.metrics().items() if k.startswith("kvrelay_requests_total"))


def test_killed_worker_is_restarted_and_the_port_keeps_answering(
    slow_pd: tuple[EngineSim, EngineSim],
    redis: RedisServer,
    proxy_factory: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    proxy = _multiworker_proxy(proxy_factory, slow_pd, redis)
    assert proxy.process is not None and proxy.process.proc is not None
    parent = proxy.process.proc.pid
    load = Load(proxy.url, threads=6).start()
    try:
        wait_until(lambda: load.count() >= 6, 60, what="load to get going")
        # Kill a worker that is serving requests right now, so its in-flight gauge is > 0.
        victim: list[int] = []

        def busy_worker() -> bool:
            victim[:] = [p for p in worker_pids(parent) if worker_inflight(tmp_path, p) > 0][:1]
            return bool(victim)

        wait_until(busy_worker, 30, what="a worker with requests in flight")
        before = _requests_total(proxy)
        os.kill(victim[0], signal.SIGKILL)
        wait_until(lambda: victim[0] not in worker_pids(parent), 30, what="the killed worker gone")
        # Reaped, so dead: its sockets are closed and the kernel hands new connections to the
        # live workers only.
        gone_at = time.monotonic()
        wait_until(
            lambda: len(worker_pids(parent)) == WORKERS, 30,
            what="a new worker in the killed one's place",
        )  # fmt: skip
        assert "restarting it in" in proxy.output()
        assert not (tmp_path / f"gauge_livesum_{victim[0]}.db").exists()
        # The port keeps answering: requests after the restart succeed.
        served = load.count()
        wait_until(lambda: load.count() >= served + 12, 60, what="requests after the restart")
    finally:
        outcomes = load.stop()
    # Only requests on the killed worker's connections can fail: those it had accepted or that
    # waited in its accept queue when it died (SO_REUSEPORT gives each worker its own queue),
    # and, once it was gone, at most one per client: the request that finds the client's
    # keep-alive connection to it closed. After that, each client's requests all succeed.
    records = list(zip(outcomes, load.started, load.client, strict=True))
    failed = [r for r in records if r[0] != "200"]
    assert all(not o.isdigit() for o, _, _ in failed), failed  # connection resets, never a 5xx
    for index in range(load.threads):
        after = [o for o, sent, c in records if c == index and sent >= gone_at]
        assert all(o == "200" for o in after[1:]), (index, after)
    # /metrics: nothing in flight once the load is over (the dead worker's gauge is gone), and
    # counters never go backwards.
    wait_until(lambda: _inflight_total(proxy) == 0, 15, what="in-flight gauge back to 0")
    assert _requests_total(proxy) >= before


def test_sigterm_to_the_parent_drains_every_worker(
    slow_pd: tuple[EngineSim, EngineSim], redis: RedisServer, proxy_factory: ProxyFactory
) -> None:
    proxy = _multiworker_proxy(proxy_factory, slow_pd, redis)
    assert proxy.process is not None and proxy.process.proc is not None
    parent = proxy.process.proc
    workers = worker_pids(parent.pid)
    load = Load(proxy.url, threads=6, max_tokens=48).start()
    try:
        wait_until(lambda: load.count() >= 6, 60, what="load to get going")
        wait_until(lambda: _inflight_total(proxy) >= 2, 30, what="requests in flight")
        signalled = time.monotonic()
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
    finally:
        outcomes = load.stop()
    # Every request whose body was on the wire before SIGTERM was answered in full; later ones
    # found the port closing. (Counted from when its client began sending, a request that
    # reached a worker only after the signal, its client slowed by a loaded host, was taken
    # for one sent before.)
    written = zip(outcomes, load.written, strict=True)
    before = [(o, t) for o, t in written if t is not None and t < signalled]
    # A failure names its outcome and how long before the signal its body was written.
    unanswered = [(o, f"{signalled - t:.3f}s before") for o, t in before if o != "200"]
    assert before and not unanswered, (len(before), unanswered)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
