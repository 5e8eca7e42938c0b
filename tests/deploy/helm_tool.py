"""Lint and render the kvrelay chart with the real Helm engine (helm-sdkpy); JSON on stdout.

Runs inside `.venv-helm` (Python 3.12, helm-sdkpy + PyYAML), never in the project venv:

    helm_tool.py lint CHART [--values FILE ...] [--set-json JSON]
    helm_tool.py render CHART --kubeconfig FILE [--values FILE ...] [--set-json JSON]
        [--skip-schema]

Values are deep-merged over the chart's values.yaml in order (files, then --set-json), like
`helm -f ... --set-json`. `lint` lints a copy of the chart whose values.yaml holds the merged
values (helm-sdkpy's lint takes no values). `render` installs into the (fake) cluster named by
the kubeconfig with the in-memory release driver and prints the rendered manifests, NOTES and
the result of validating every manifest against the Kubernetes API schemas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest with schemas.
KUBE_VERSIONS = ("1.25.0", "1.37.0")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's value merge: maps merge key by key, anything else replaces; null deletes."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def user_values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in args.values:
        values = merge(values, yaml.safe_load(Path(path).read_text()) or {})
    if args.set_json:
        values = merge(values, json.loads(args.set_json))
    return values


def reexec_isolated() -> None:
    """Re-run this script with Helm's home, caches and release driver set in the environment.

    The Go library reads the environment the process started with, not later `os.environ`
    changes, so the settings must be there from exec. Caches go to a fresh temporary home so
    nothing lands in $HOME or the working tree; releases stay in memory.
    """
    if os.environ.get("KVRELAY_HELM_TOOL_HOME"):
        return
    home = tempfile.mkdtemp(prefix="kvrelay-helm-")
    env = dict(os.environ, KVRELAY_HELM_TOOL_HOME=home, HOME=home, HELM_DRIVER="memory")
    for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[name] = os.path.join(home, name.lower())
    try:
        code = subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)
    raise SystemExit(code)


def lint(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import helm_sdkpy

    chart = tmp / "chart"
    shutil.copytree(args.chart, chart)
    base = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    # JSON is YAML: the merged values replace values.yaml as JSON.
    (chart / "values.yaml").write_text(json.dumps(merge(base, user_values(args))))
    result = asyncio.run(helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(str(chart)))
    messages = [
        {"severity": m.get("Severity"), "path": m.get("Path")} for m in result.get("Messages") or []
    ]
    return {"ok": True, "messages": messages, "errors": len(result.get("Errors") or [])}


def render(args: argparse.Namespace) -> dict[str, Any]:
    import helm_sdkpy

    config = helm_sdkpy.Configuration(namespace="kvrelay-test", kubeconfig=args.kubeconfig)
    try:
        release = asyncio.run(
            helm_sdkpy.Install(config).run(
                "rel",
                str(Path(args.chart).resolve()),
                values=user_values(args) or None,
                wait=False,
                timeout=60,
                skip_schema_validation=args.skip_schema,
            )
        )
    except helm_sdkpy.HelmError as exc:
        return {"ok": False, "error": str(exc)}
    manifests = [d for d in yaml.safe_load_all(release.get("manifest", "")) if d]
    notes = (release.get("info") or {}).get("notes", "")
    invalid, unvalidated = validate(manifests)
    return {
        "ok": True,
        "manifests": manifests,
        "notes": notes,
        "invalid": invalid,
        "unvalidated": unvalidated,
    }


def validate(manifests: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Check each manifest against the Kubernetes API schemas (strict: unknown fields fail).

    Both ends of the chart's supported range (Chart.yaml kubeVersion) are checked. Kinds with
    no bundled schema (CRDs such as ServiceMonitor) are listed as unvalidated.
    """
    import kubernetes_validate

    invalid: list[str] = []
    unvalidated: list[str] = []
    for manifest in manifests:
        name = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unvalidated.append(name)
                break
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                invalid.append(f"{name} (Kubernetes {version}) at {path}: {exc.message}")
    return invalid, sorted(set(unvalidated))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["lint", "render"])
    parser.add_argument("chart")
    parser.add_argument("--values", action="append", default=[])
    parser.add_argument("--set-json", default="")
    parser.add_argument("--kubeconfig", default="")
    parser.add_argument("--skip-schema", action="store_true")
    args = parser.parse_args()
    reexec_isolated()
    with tempfile.TemporaryDirectory(prefix="kvrelay-helm-lint-") as tmp:
        out = lint(args, Path(tmp)) if args.command == "lint" else render(args)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
