"""Starting the proxy-bound benchmark's processes (fake engines, relays) for the bench tests."""

from __future__ import annotations

import os
import sys

from tests.harness import REPO_ROOT, ServerProcess, free_port, http_ready

SECRET = "bench-test-secret"  # the fakes' side channels need one, and so does kvrelay


def start(
    argv: list[str], ready_url: str, name: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """A process of the benchmark, ready once `ready_url` answers (use it as a `with` block);
    `env`: more environment (settings) for it."""
    env = {
        "KVRELAY_CONNECTOR_SECRET": SECRET,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    return ServerProcess(argv, http_ready(ready_url), env=env, ready_timeout=60, name=name)


def fake_engine(role: str) -> tuple[list[str], str, int]:
    """argv, base URL and side-channel port of a fake engine (`bench/fake_engine.py`)."""
    port, side = free_port(), free_port()
    argv = [
        sys.executable, "-m", "bench.fake_engine", "--role", role, "--port", str(port),
        "--side-channel-port", str(side), "--engine-id", f"fake-{role}",
    ]  # fmt: skip
    return argv, f"http://127.0.0.1:{port}", side
