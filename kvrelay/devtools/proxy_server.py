"""Start the proxy (`python -m kvrelay.proxy.cli serve`) in front of enginesim engines.

`ProxyServer` is every dev fleet's proxy: the tests' (through the fixtures in
`tests/conftest.py`, `proxy_factory`, `pd_fleet`), the chaos fleet's, the demo's and the
benchmarks'. It is a real subprocess on a free loopback port. The tests hand it its fleet and
settings as `KVRELAY_*` variables; the demo and the benchmarks as an operator types them
(`flags`: `--prefill`, `--decode`, `--side-channels`).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvrelay.devtools.engines import EngineSim, dev_env
from kvrelay.devtools.process import (
    ManagedServer,
    ServerProcess,
    free_port,
    http_ready,
    wait_until,
)
from kvrelay.devtools.prometheus import parse_samples

# Settings every test proxy gets unless overridden: the suites check the P->D reuse path turn by
# turn (P's loaded tokens, reuse hits), so they pin the policy that always takes it
# (tests/proxy/test_routing.py and test_engine_load.py cover the others); probes often, so a
# fleet change shows soon; quiet.
DEV_PROXY_SETTINGS = {
    "probe_interval_s": "0.2",
    "routing_policy": "always_p",
    "log_level": "WARNING",
}


class EngineAddress(Protocol):
    """An engine a proxy is put in front of: a URL, and a side channel where it has one."""

    @property
    def url(self) -> str: ...

    @property
    def side_channel(self) -> str | None: ...


@dataclass
class ProxyServer(ManagedServer):
    """One running proxy process."""

    prefill: Sequence[EngineAddress | str]
    decode: Sequence[EngineAddress | str]
    settings: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)  # other variables (OTEL_*)
    port: int = field(default_factory=free_port)
    process: ServerProcess | None = None
    # The fleet as flags (`--host`, `--port`, `--prefill`, `--decode`, `--side-channels`)
    # instead of variables; `args` follow them.
    flags: bool = False
    args: Sequence[str] = ()
    # The whole environment before the settings; None: `dev_env()` and `DEV_PROXY_SETTINGS`.
    env_base: Mapping[str, str] | None = None
    cpus: str | None = None  # `taskset` CPU list, None: not pinned
    cwd: Path | None = None  # where it runs: `python -m` imports `kvrelay` from there first
    name: str = ""  # its log's name, default `proxy-<port>`
    ready_timeout: float = 30.0
    # What `python` runs before `serve`: the proxy's CLI, or a wrapper that hands on to it
    # (bench/_features_off.py's, which switches features off first).
    launcher: Sequence[str] = ("-m", "kvrelay.proxy.cli")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _urls(engines: Sequence[EngineAddress | str]) -> list[str]:
        return [e if isinstance(e, str) else e.url for e in engines]

    def _side_channels(self) -> list[str]:
        engines = [e for e in [*self.prefill, *self.decode] if not isinstance(e, str)]
        return [f"{e.url}={e.side_channel}" for e in engines if e.side_channel is not None]

    def env(self) -> dict[str, str]:
        if self.env_base is None:
            env = dev_env()
            env.update({f"KVRELAY_{k.upper()}": v for k, v in DEV_PROXY_SETTINGS.items()})
        else:
            env = dict(self.env_base)
        if not self.flags:
            env.update(
                {
                    "KVRELAY_HOST": "127.0.0.1",
                    "KVRELAY_PORT": str(self.port),
                    "KVRELAY_PREFILL": ",".join(self._urls(self.prefill)),
                    "KVRELAY_DECODE": ",".join(self._urls(self.decode)),
                    "KVRELAY_SIDE_CHANNELS": ",".join(self._side_channels()),
                }
            )
        env.update({f"KVRELAY_{k.upper()}": v for k, v in self.settings.items()})
        env.update(self.extra_env)
        return env

    def argv(self) -> list[str]:
        argv = [sys.executable, *self.launcher, "serve"]
        if self.flags:
            argv += ["--host", "127.0.0.1", "--port", str(self.port)]
            argv += ["--prefill", *self._urls(self.prefill)]
            argv += ["--decode", *self._urls(self.decode)]
            argv += ["--side-channels", *self._side_channels()]
        else:
            argv += ["--env-file", ""]
        return [*argv, *self.args]

    def spawn(self, ready_path: str = "/health") -> ProxyServer:
        """Start the process without waiting for it (to start it beside its engines)."""
        self.process = ServerProcess(
            self.argv(),
            http_ready(self.url + ready_path),
            env=self.env(),
            ready_timeout=self.ready_timeout,
            name=self.name or f"proxy-{self.port}",
            cwd=self.cwd,
            cpus=self.cpus,
        ).spawn()
        return self

    def start(self, ready_path: str = "/health") -> ProxyServer:
        """Start the process and wait until `ready_path` answers 2xx (bounded)."""
        self.spawn(ready_path)
        assert self.process is not None
        self.process.wait_ready()
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

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        """An admin API call with the admin key the proxy was given; its answer (any status
        but 200 raises)."""
        key = self.settings.get("admin_key", "")
        status, answer, _ = self.call(
            method, path, body, headers={"Authorization": f"Bearer {key}"}
        )
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {answer}")
        return answer

    def engine_load(self, role: str = "decode", index: int = 0) -> dict[str, Any] | None:
        """The proxy's latest load reading of the `index`-th engine of the `role` pool, as
        `GET /admin/backends` shows it (None: not read yet)."""
        load: dict[str, Any] | None = self.admin("GET", "/admin/backends")[role][index]["load"]
        return load

    def events_cached(self, body: dict[str, Any], role: str = "prefill") -> dict[str, int]:
        """Per engine URL of the `role` pool, the tokens of `body`'s prompt that its own KV
        events say it caches (`POST /admin/prefix-cache`)."""
        answer = self.admin("POST", "/admin/prefix-cache", body)
        return {e["url"]: int(e["events_tokens"]) for e in answer[role]}

    def events_connected(self, *urls: str) -> bool:
        """The proxy's subscriptions to the KV events of the engines at `urls` have reached
        them (`GET /admin/backends`' `kv_events_connected`): what they publish from now on
        arrives. A test waits on this before the first request whose events it looks for."""
        answer = self.admin("GET", "/admin/backends")
        connected = {
            b["url"]: b.get("kv_events_connected") for role in answer.values() for b in role
        }
        return all(connected.get(url.rstrip("/")) for url in urls)

    def wait_for_events(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """`wait_until` a condition on what the proxy's KV events index shows (`events_cached`,
        `events_blocks`). On a timeout the error also gives the feed's own counters (blocks
        stored, adopted, orphaned, removed; gaps; batches), which tell an event never received
        or never named (a missed subscription, an unknown parent) from a slow engine."""
        try:
            wait_until(condition, timeout, what=what)
        except TimeoutError as timed_out:
            counters = {
                name: value
                for name, value in self.metrics().items()
                if name.startswith(
                    (
                        "kvrelay_kv_events_total",
                        "kvrelay_kv_events_gaps_total",
                        "kvrelay_kv_events_replays_total",
                        "kvrelay_kv_events_connected",
                        "kvrelay_kv_events_lag_seconds_count",
                    )
                )
            }
            raise TimeoutError(f"{timed_out}; the proxy's KV events: {counters}") from None

    def events_blocks(self, role: str = "prefill") -> dict[str, int]:
        """Per engine URL of the `role` pool, the blocks its KV events put in the proxy's index
        (`GET /admin/backends`' `kv_events_blocks`)."""
        answer = self.admin("GET", "/admin/backends")
        return {b["url"]: int(b.get("kv_events_blocks") or 0) for b in answer[role]}

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
        prefill: Sequence[EngineAddress | str],
        decode: Sequence[EngineAddress | str],
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
