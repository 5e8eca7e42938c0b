"""Start the proxy (`python -m kvrelay.proxy.cli serve`) for tests, in front of enginesim engines.

Used through the fixtures in `tests/conftest.py` (`proxy_factory`, `pd_fleet`). The proxy is a
real subprocess on a free loopback port; settings go in as `KVRELAY_*` env vars.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.devtools.engines import CONNECTOR_SECRET, ENGINE_ENV, EngineSim
from kvrelay.devtools.process import ManagedServer, ServerProcess, free_port, http_ready
from kvrelay.devtools.prometheus import parse_samples


@dataclass
class ProxyServer(ManagedServer):
    """One running proxy process."""

    prefill: Sequence[EngineSim | str]
    decode: Sequence[EngineSim | str]
    settings: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)  # other variables (OTEL_*)
    port: int = field(default_factory=free_port)
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _urls(engines: Sequence[EngineSim | str]) -> str:
        return ",".join(e if isinstance(e, str) else e.url for e in engines)

    def env(self) -> dict[str, str]:
        side = ",".join(
            f"{e.url}=127.0.0.1:{e.side_channel_port}"
            for e in [*self.prefill, *self.decode]
            if isinstance(e, EngineSim) and e.connector
        )
        env = {
            **ENGINE_ENV,
            "KVRELAY_CONNECTOR_SECRET": CONNECTOR_SECRET,
            "KVRELAY_HOST": "127.0.0.1",
            "KVRELAY_PORT": str(self.port),
            "KVRELAY_PREFILL": self._urls(self.prefill),
            "KVRELAY_DECODE": self._urls(self.decode),
            "KVRELAY_SIDE_CHANNELS": side,
            "KVRELAY_PROBE_INTERVAL_S": "0.2",
            # The suites check the P->D reuse path turn by turn (P's loaded tokens, reuse hits),
            # so they pin the policy that always takes it; tests/proxy/test_routing.py and
            # test_engine_load.py cover the other policies.
            "KVRELAY_ROUTING_POLICY": "always_p",
            "KVRELAY_LOG_LEVEL": "WARNING",
        }
        env.update({f"KVRELAY_{k.upper()}": v for k, v in self.settings.items()})
        env.update(self.extra_env)
        return env

    def start(self, ready_path: str = "/health") -> ProxyServer:
        self.process = ServerProcess(
            [sys.executable, "-m", "kvrelay.proxy.cli", "serve", "--env-file", ""],
            http_ready(self.url + ready_path),
            env=self.env(),
            ready_timeout=30,
            name=f"proxy-{self.port}",
        ).start()
        return self

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, Any, dict[str, str]]:
        """One HTTP call; returns (status, parsed JSON or text, headers)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, payload, hdrs = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as err:
            status, payload, hdrs = err.code, err.read(), dict(err.headers)
        try:
            return status, json.loads(payload), hdrs
        except ValueError:
            return status, payload.decode(errors="replace"), hdrs

    def metrics(self) -> dict[str, float]:
        return parse_samples(self.metrics_text())

    def metrics_text(self) -> str:
        """`/metrics`, sending the metrics key when the proxy was given one."""
        key = self.settings.get("metrics_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request(self.url + "/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return str(resp.read().decode())


class ProxyFactory:
    """Starts proxies for one test and stops them all afterwards."""

    def __init__(self) -> None:
        self.proxies: list[ProxyServer] = []

    def __call__(
        self,
        prefill: Sequence[EngineSim | str],
        decode: Sequence[EngineSim | str],
        ready_path: str = "/health",
        env: dict[str, str] | None = None,
        **settings: str,
    ) -> ProxyServer:
        """Start a proxy; `settings` become KVRELAY_* variables, `env` is added as it is."""
        proxy = ProxyServer(prefill, decode, settings, env or {})
        self.proxies.append(proxy)
        return proxy.start(ready_path)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()


@dataclass
class ProxiedPair:
    """One P, one D and a proxy in front of them."""

    prefill: EngineSim
    decode: EngineSim
    proxy: ProxyServer

    def wait_clean(self, timeout: float = 15.0) -> None:
        """Both engines back to their starting state: nothing held, nothing running."""
        self.prefill.wait_idle(timeout)
        self.decode.wait_idle(timeout)

    def finish(self, timeout: float = 15.0) -> None:
        """Stop the proxy (it releases every conversation D still holds) and check that
        nothing else was left held: what remains would be stranded."""
        self.proxy.stop()
        self.wait_clean(timeout)
