"""The proxy image's constraints file (`deploy/proxy-constraints.txt`): what it is made from.

The image installs the project's base dependencies and its `kubernetes`, `otel` and
`kv-events` extras, and builds the wheel with the `[build-system]` requirements; all of them are
pinned by the constraints file. The file carries a digest of those pyproject requirements, so a
check without network (`tests/deploy/test_image_lock.py`) can tell that pyproject changed since
the file was made (`scripts/lock_image.py` remakes it).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = REPO_ROOT / "pyproject.toml"
LOCK_FILE = REPO_ROOT / "deploy" / "proxy-constraints.txt"
PROJECT = "kvrelay"
IMAGE_EXTRAS = ("kubernetes", "otel", "kv-events")
DIGEST_PREFIX = "# inputs-sha256: "


def image_requirements() -> tuple[list[str], list[str]]:
    """(build-system requirements, runtime requirements) of the proxy image, from pyproject."""
    data = tomllib.loads(PYPROJECT.read_text())
    project = data["project"]
    runtime = list(project["dependencies"])
    for extra in IMAGE_EXTRAS:
        runtime += project["optional-dependencies"][extra]
    return list(data["build-system"]["requires"]), runtime


def inputs_digest() -> str:
    build, runtime = image_requirements()
    blob = json.dumps({"build": build, "runtime": runtime}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def render_lock(pins: dict[str, str], digest: str) -> str:
    lines = [
        "# Pinned releases for the proxy image (Dockerfile): the base dependencies, the",
        f"# {', '.join(IMAGE_EXTRAS)} extras and the build backend, with all they pull in.",
        "# Made by scripts/lock_image.py from pyproject.toml; remake it when those requirements",
        "# change (tests/deploy/test_image_lock.py fails until then).",
        DIGEST_PREFIX + digest,
    ]
    lines += [f"{name}=={version}" for name, version in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def read_lock() -> tuple[str | None, dict[str, str]]:
    """(the recorded inputs digest, name -> pinned version) of the constraints file."""
    digest = None
    pins: dict[str, str] = {}
    for raw in LOCK_FILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith(DIGEST_PREFIX):
            digest = line.removeprefix(DIGEST_PREFIX).strip()
        elif line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return digest, pins
