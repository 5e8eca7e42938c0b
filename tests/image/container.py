"""The container engine `make test-image` uses: Docker when its daemon answers, else podman
(the same choice as scripts/build-image.sh), driven through its command line."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any


def engine() -> str:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode == 0:
        return "docker"
    podman = shutil.which("podman")
    assert podman, "neither a running Docker nor podman: run `make test-image`"
    return "podman"


class Engine:
    """One container engine's CLI."""

    def __init__(self) -> None:
        self.name = engine()

    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        proc = subprocess.run([self.name, *args], capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{self.name} {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def exec(self, container: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.name, "exec", container, *argv], capture_output=True, text=True, timeout=60
        )

    def inspect(self, what: str, name: str) -> dict[str, Any]:
        data = json.loads(self.run(what, "inspect", name))
        first: dict[str, Any] = data[0]
        return first

    def exists(self, image: str) -> bool:
        return self.run("image", "inspect", image, check=False) != ""
