"""Fixtures for the deployment tests: the Helm engine in `.venv-helm` and a chart renderer.

helm-sdkpy needs Python 3.12 while the project runs on 3.11, so the Helm engine lives in its own
virtual environment, created once per machine (gitignored `.venv-*`) and called by subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.fake_kube import FakeKube, fake_kube
from tests.harness import REPO_ROOT

CHART = REPO_ROOT / "helm" / "kvrelay"
HELM_VENV = REPO_ROOT / ".venv-helm"
HELM_TOOL = Path(__file__).with_name("helm_tool.py")
HELM_REQUIREMENTS = Path(__file__).with_name("helm-requirements.txt")
PY312_CANDIDATES = ("/root/.pyenv/versions/3.12.1/bin/python3.12", "python3.12")


def _find_python312() -> str:
    # A pyenv shim is on PATH even when it cannot run 3.12, so each candidate is tried.
    for candidate in PY312_CANDIDATES:
        found = shutil.which(candidate)
        if not found:
            continue
        probe = subprocess.run(
            [found, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return found
    raise RuntimeError(f"the Helm tests need Python 3.12 for helm-sdkpy; tried {PY312_CANDIDATES}")


def _helm_venv_ready(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import helm_sdkpy, kubernetes_validate, yaml"],
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


@pytest.fixture(scope="session")
def helm_python() -> Path:
    """`.venv-helm/bin/python` with helm-sdkpy and PyYAML, created on first use."""
    python = HELM_VENV / "bin" / "python"
    if not _helm_venv_ready(python):
        subprocess.run([_find_python312(), "-m", "venv", "--clear", str(HELM_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(HELM_REQUIREMENTS)],
            check=True,
            timeout=600,
        )
    return python


@dataclass
class Rendered:
    """What one `helm install` rendered: manifests (as dicts), NOTES.txt, schema findings."""

    manifests: list[dict[str, Any]]
    notes: str
    # Kubernetes API schema violations, and kinds without a bundled schema (CRDs).
    invalid: list[str]
    unvalidated: list[str]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str = "rel-kvrelay") -> dict[str, Any]:
        found = [m for m in self.all(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, got {[m['metadata'] for m in found]}"
        return found[0]

    def proxy_container(self) -> dict[str, Any]:
        pod = self.one("Deployment")["spec"]["template"]["spec"]
        return dict(pod["containers"][0])


@dataclass
class Helm:
    """Runs tests/deploy/helm_tool.py in `.venv-helm` against the chart and a fake cluster."""

    python: Path
    kube: FakeKube
    workdir: Path

    def _run(self, args: list[str]) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
        proc = subprocess.run(
            [str(self.python), str(HELM_TOOL), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=self.workdir,
        )
        assert proc.returncode == 0, f"helm_tool failed:\n{proc.stderr}"
        return dict(json.loads(proc.stdout))

    @staticmethod
    def _values_args(values_files: list[Path], set_values: dict[str, Any] | None) -> list[str]:
        args = [a for f in values_files for a in ("--values", str(f))]
        if set_values:
            args += ["--set-json", json.dumps(set_values)]
        return args

    def lint(
        self, values_files: list[Path] | None = None, set_values: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self._run(["lint", str(CHART), *self._values_args(values_files or [], set_values)])

    def install(
        self,
        values_files: list[Path] | None = None,
        set_values: dict[str, Any] | None = None,
        skip_schema: bool = False,
    ) -> dict[str, Any]:
        """Render by installing into a fresh fake cluster; the raw result (ok / error)."""
        self.kube.reset()
        args = ["render", str(CHART), "--kubeconfig", str(self.kube.kubeconfig(self.workdir))]
        args += self._values_args(values_files or [], set_values)
        if skip_schema:
            args.append("--skip-schema")
        return self._run(args)

    def render(
        self, values_files: list[Path] | None = None, set_values: dict[str, Any] | None = None
    ) -> Rendered:
        out = self.install(values_files, set_values)
        assert out["ok"], out.get("error")
        rendered = Rendered(out["manifests"], out["notes"], out["invalid"], out["unvalidated"])
        assert rendered.invalid == [], "\n".join(rendered.invalid)
        assert set(rendered.unvalidated) <= {"ServiceMonitor/rel-kvrelay"}, rendered.unvalidated
        return rendered

    def refusal(self, set_values: dict[str, Any], skip_schema: bool = False) -> str:
        """The error Helm gives for values the chart must refuse."""
        out = self.install(set_values=set_values, skip_schema=skip_schema)
        assert not out["ok"], f"chart accepted {set_values}"
        return str(out["error"])


@pytest.fixture
def helm(helm_python: Path) -> Iterator[Helm]:
    """A Helm runner with its own fake cluster and scratch directory, torn down afterwards."""
    with fake_kube() as kube, tempfile.TemporaryDirectory(prefix="kvrelay-deploy-") as tmp:
        yield Helm(python=helm_python, kube=kube, workdir=Path(tmp))
