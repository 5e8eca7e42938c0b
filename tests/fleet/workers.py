"""Helpers for tests of a proxy with several worker processes: find the workers, read one
worker's Prometheus multiprocess files, and run steady client load against the port."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client import multiprocess

MODEL = "kvrelay-sim"


def worker_pids(parent: int) -> list[int]:
    """The proxy's worker processes (spawned children), not multiprocessing helpers."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{parent}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{parent}/task/{task}/children").read_text()
                for pid in (int(p) for p in text.split()):
                    with contextlib.suppress(OSError):
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                        if b"spawn_main" in cmdline:
                            out.append(pid)
    return sorted(out)


def worker_inflight(metrics_dir: Path, pid: int) -> float:
    """`kvrelay_inflight_requests` as written by one worker (its live-gauge file)."""
    path = metrics_dir / f"gauge_livesum_{pid}.db"
    if not path.exists():
        return 0.0
    total = 0.0
    for metric in multiprocess.MultiProcessCollector.merge([str(path)], accumulate=False):
        for sample in metric.samples:
            if sample.name == "kvrelay_inflight_requests":
                total += sample.value
    return total


@dataclass
class Load:
    """`threads` clients, each on its own keep-alive connection, sending completions until
    stopped; every outcome is recorded (status code or exception name), with `started` the
    `time.monotonic()` at which its client began sending it, `written` when its body had been
    written to the socket (None: it never was; httpcore's trace event) and `client` the index
    of the client."""

    base_url: str
    threads: int = 4
    max_tokens: int = 16
    outcomes: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    written: list[float | None] = field(default_factory=list)
    client: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": MODEL, "prompt": f"client {index} request {n} " * 8,
                        "max_tokens": self.max_tokens}  # fmt: skip
                written: list[float] = []

                def trace(event: str, info: dict[str, object], into: list[float] = written) -> None:
                    if event == "http11.send_request_body.complete":
                        into.append(time.monotonic())

                sent = time.monotonic()
                try:
                    answer = client.post("/v1/completions", json=body, extensions={"trace": trace})
                    outcome = str(answer.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                with self._lock:
                    self.outcomes.append(outcome)
                    self.started.append(sent)
                    self.written.append(written[0] if written else None)
                    self.client.append(index)

    def start(self) -> Load:
        for i in range(self.threads):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def count(self, outcome: str = "200") -> int:
        with self._lock:
            return self.outcomes.count(outcome)

    def stop(self) -> list[str]:
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout=60)
        with self._lock:
            return list(self.outcomes)
