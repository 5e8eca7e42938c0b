"""Pin the proxy image's dependencies: writes `deploy/proxy-constraints.txt`.

The Dockerfile installs the wheel with `[kubernetes,otel,kv-events]` and builds it with the
`[build-system]` requirements, both under this constraints file, so two builds resolve the same
releases. The file records a digest of the pyproject requirements it was made from;
`tests/deploy/test_image_lock.py` checks (offline) that it is still current.

Run with the image's Python (3.11) and access to the package index:
`.venv/bin/python scripts/lock_image.py`. Only this machine's index settings are used: local
wheel folders and extra indexes in pip's config are left out, so every pin is a public release.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from kvrelay.devtools import image_lock  # noqa: E402

# pip options that would let releases in from outside the package index.
_LOCAL_SOURCES = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")


def resolve(requirements: list[str]) -> dict[str, str]:
    """Name -> version of everything pip installs for `requirements` on this Python."""
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_SOURCES}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
             "--quiet", "--report", str(report), *requirements],
            check=True, env=env,
        )  # fmt: skip
        data = json.loads(report.read_text())
    pins = {}
    for item in data["install"]:
        meta = item["metadata"]
        pins[meta["name"].lower().replace("_", "-")] = meta["version"]
    return pins


def main() -> int:
    if sys.version_info[:2] != (3, 11):
        print("run with Python 3.11, the image's Python", file=sys.stderr)
        return 2
    build, _ = image_lock.image_requirements()
    pins = resolve([f"{REPO_ROOT}[{','.join(image_lock.IMAGE_EXTRAS)}]", *build])
    pins.pop(image_lock.PROJECT, None)
    image_lock.LOCK_FILE.write_text(image_lock.render_lock(pins, image_lock.inputs_digest()))
    print(f"wrote {image_lock.LOCK_FILE.relative_to(REPO_ROOT)}: {len(pins)} pins")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
