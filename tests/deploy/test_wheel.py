"""The proxy wheel installs into a fresh environment without torch or nixl, and starts.

These are the Dockerfile's steps (build stage: `pip wheel --no-deps`; proxy-venv stage: install
the wheel with its base dependencies), run on this machine against the package mirror.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

# What the Dockerfile's build stage copies.
BUILD_CONTEXT = ("pyproject.toml", "README.md", "proxy", "kvcache_map", "connector", "enginesim")


@pytest.mark.timeout(900)
def test_wheel_installs_without_torch_or_nixl_and_serve_help_runs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_CONTEXT:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), str(src)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("kvrelay-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    vpip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*vpip, "install", "-q", str(wheel)], check=True, timeout=600)

    installed = subprocess.run(
        [*vpip, "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert "kvrelay" in names
    assert not names & {"torch", "nixl", "numpy"}, sorted(names)

    help_run = subprocess.run(
        [str(venv / "bin" / "kvrelay"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert help_run.returncode == 0, help_run.stdout + help_run.stderr
    for flag in ("--prefill", "--decode", "--map-url", "--workers"):
        assert flag in help_run.stdout, flag
