"""The proxy wheel installs into a fresh environment without torch or nixl, and serves.

These are the Dockerfile's steps (build stage: `pip wheel --no-deps`; proxy-venv stage: install
the wheel with its base dependencies), run on this machine against the package mirror. The
installed proxy then serves a chat through real enginesim P and D engines, and its probes mean
what the chart uses them for: /health is liveness, /ready drops when D goes away.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvrelay.devtools import EngineSim, ProxyServer
from tests.harness import REPO_ROOT, ServerProcess, http_ready, wait_until

# What the Dockerfile's build stage copies.
BUILD_CONTEXT = ("pyproject.toml", "README.md", "kvrelay")
# The wheel's venv must see only what is installed in it: a PYTHONPATH pointing at a checkout
# would let pip and imports find the source tree instead of the wheel.
WHEEL_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the kvrelay wheel and its base dependencies installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_CONTEXT:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("kvrelay-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    vpython = str(venv / "bin" / "python")
    subprocess.run(
        [vpython, "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600, env=WHEEL_ENV
    )
    return venv


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.timeout(900)
def test_wheel_installs_without_torch_or_nixl_and_serve_help_runs(wheel_venv: Path) -> None:
    installed = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
        env=WHEEL_ENV,
    ).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert "kvrelay" in names
    assert not names & {"torch", "nixl", "numpy"}, sorted(names)
    # Everything lives under one `kvrelay` namespace: no generic top-level module is installed
    # (a `proxy` or `connector` of ours would shadow or be shadowed by someone else's). The dev
    # tools ship (the benchmarks and tests use them); `bench` and `tests` do not.
    namespace = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-c",
         "import importlib.util as u, kvrelay, kvrelay.proxy, kvrelay.connector\n"
         "import kvrelay.devtools.engines, kvrelay.devtools.chaos_load\n"
         "names = ('proxy', 'connector', 'kvcache_map', 'enginesim', 'bench', 'tests')\n"
         "stray = [m for m in names if u.find_spec(m)]\n"
         "assert not stray, stray\n"
         "print(kvrelay.__version__)"],
        capture_output=True, text=True, timeout=60, cwd=wheel_venv, env=WHEEL_ENV,
    )  # fmt: skip
    assert namespace.returncode == 0, namespace.stdout + namespace.stderr
    assert f"kvrelay=={namespace.stdout.strip()}" in installed, "one version, in kvrelay/__init__"
    help_run = subprocess.run(
        [str(wheel_venv / "bin" / "kvrelay"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=wheel_venv,
        env=WHEEL_ENV,
    )
    assert help_run.returncode == 0, help_run.stdout + help_run.stderr
    for flag in ("--prefill", "--decode", "--map-url", "--workers"):
        assert flag in help_run.stdout, flag


@pytest.mark.timeout(900)
def test_installed_proxy_serves_and_its_probes_track_the_fleet(
    wheel_venv: Path, pd_engines: tuple[EngineSim, EngineSim]
) -> None:
    prefill, decode = pd_engines
    # The same settings the shared proxy fixture uses, run from the wheel's console script in a
    # directory outside the checkout, so only the installed package can be imported.
    settings = ProxyServer([prefill], [decode], {"eject_after_failures": "1"})
    proxy = ServerProcess(
        [str(wheel_venv / "bin" / "kvrelay"), "serve"],
        http_ready(settings.url + "/ready"),
        env={**settings.env(), "PYTHONPATH": ""},  # empty: the installed package only
        ready_timeout=60,
        name="wheel-proxy",
        cwd=wheel_venv,
    ).start()
    try:
        status, body, _ = settings.call(
            "POST",
            "/v1/chat/completions",
            {"model": "kvrelay-sim", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 4},
        )  # fmt: skip
        assert status == 200, body
        assert body["choices"][0]["message"]["content"]
        with urllib.request.urlopen(settings.url + "/metrics", timeout=5) as resp:
            assert "kvrelay_requests_total" in resp.read().decode()
        # Liveness stays up while readiness follows the fleet: without D it must go 503.
        decode.stop()
        wait_until(lambda: _status(settings.url + "/ready") == 503, 30, what="/ready to drop")
        assert _status(settings.url + "/health") == 200
    finally:
        proxy.stop()
