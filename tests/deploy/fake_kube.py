"""A fake Kubernetes API server, just enough for `helm install` to render and create a release.

No Kubernetes runs here, and helm-sdkpy (the Helm Go engine behind a Python binding) offers no
`helm template`: its install action is the only call that renders a chart with given values.
This server answers the discovery, the release-storage Secrets and the create calls of that
action on 127.0.0.1 and records every object Helm sends, so the tests can assert on exactly what
Helm rendered. It is a fake by name: it applies nothing and schedules nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvrelay.devtools import ThreadedApp
from tests.harness import free_port

# group/version -> [(plural, Kind, namespaced)] for every kind the chart may render.
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("pods", "Pod", True),
        ("namespaces", "Namespace", False),
    ],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True)],
    "rbac.authorization.k8s.io/v1": [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
    ],
}


def _resource_list(group_version: str) -> dict[str, Any]:
    verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": verbs,
            }
            for plural, kind, namespaced in RESOURCES[group_version]
        ],
    }


def _group_list() -> dict[str, Any]:
    groups = []
    for group_version in RESOURCES:
        if "/" not in group_version:
            continue
        group, version = group_version.split("/")
        gv = {"groupVersion": group_version, "version": version}
        groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def _not_found() -> web.Response:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
    return web.json_response({**status, "reason": "NotFound", "code": 404}, status=404)


@dataclass
class FakeKube:
    """Stores objects by API path; `created` keeps every object Helm created, in order."""

    port: int
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        """Forget every object: the next install meets an empty cluster."""
        self.objects.clear()
        self.created.clear()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if path == "/version":
            return web.json_response(
                {"major": "1", "minor": "30", "gitVersion": "v1.30.0", "platform": "linux/amd64"}
            )
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            return web.json_response(_group_list())
        if path == "/api/v1":
            return web.json_response(_resource_list("v1"))
        if path.startswith("/apis/") and path.count("/") == 3:
            group_version = path.removeprefix("/apis/")
            if group_version in RESOURCES:
                return web.json_response(_resource_list(group_version))
            return _not_found()
        return await self._objects(request, path)

    async def _objects(self, request: web.Request, path: str) -> web.StreamResponse:
        if request.method == "GET":
            if path in self.objects:
                return web.json_response(self.objects[path])
            if path.endswith("s") and self._is_collection(path):
                items = [o for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path]
                selector = request.query.get("labelSelector", "")
                items = [o for o in items if self._matches(o, selector)]
                return web.json_response({"kind": "List", "apiVersion": "v1", "items": items})
            return _not_found()
        if request.method == "POST":
            obj = json.loads(await request.read())
            obj.setdefault("metadata", {})
            obj["metadata"].setdefault("resourceVersion", "1")
            obj["metadata"].setdefault("uid", f"uid-{len(self.objects)}")
            self.objects[f"{path}/{obj['metadata']['name']}"] = obj
            self.created.append(obj)
            return web.json_response(obj, status=201)
        if request.method in ("PUT", "PATCH"):
            if request.method == "PUT":
                self.objects[path] = json.loads(await request.read())
            return web.json_response(self.objects.get(path, {}))
        if request.method == "DELETE":
            self.objects.pop(path, None)
            return web.json_response({"kind": "Status", "status": "Success"})
        return _not_found()

    @staticmethod
    def _is_collection(path: str) -> bool:
        # /api/v1/namespaces/NS/secrets or /apis/G/V/namespaces/NS/PLURAL
        parts = path.strip("/").split("/")
        return (parts[0] == "api" and len(parts) == 5) or (parts[0] == "apis" and len(parts) == 6)

    @staticmethod
    def _matches(obj: dict[str, Any], selector: str) -> bool:
        labels = obj.get("metadata", {}).get("labels", {}) or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig.yaml"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{self.port}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, namespace: default}}]\n"
            "current-context: fake\nusers: [{name: fake, user: {}}]\n"
        )
        return path


@contextmanager
def fake_kube() -> Iterator[FakeKube]:
    """Serve a FakeKube on a free loopback port in a background thread; stop it on exit."""
    kube = FakeKube(port=free_port())
    with ThreadedApp(kube.app(), kube.port, "fake-kube"):
        yield kube
