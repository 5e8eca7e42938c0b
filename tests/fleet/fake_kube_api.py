"""A fake Kubernetes API server for EndpointSlice discovery tests (no cluster runs here).

It serves `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices` as list and as watch
the way the real API server does: every change bumps a resourceVersion; a watch from version V
streams the changes after V, sends BOOKMARK events while idle (allowWatchBookmarks), ends after
timeoutSeconds, and answers an ERROR 410 Gone event when V is older than its history (after
`compact()`). `drop_watches()` cuts every open watch mid-way, as a restarting API server or a
load balancer would. Label selectors: `key=value` terms (the matcher of tests/deploy's fake).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvrelay.devtools import ThreadedApp
from tests.deploy.fake_kube import FakeKube
from tests.harness import free_port

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
BOOKMARK_EVERY_S = 0.3


@dataclass
class FakeEndpointSlices:
    """The slices, their change history and the open watches (state lives on its loop)."""

    port: int = field(default_factory=free_port)
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 1
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    oldest: int = 1  # watches from before this version get 410 Gone
    lists: int = 0
    watches: int = 0
    gone_sent: int = 0
    loop: asyncio.AbstractEventLoop | None = None
    # Bound to the server's loop on first use there.
    _changed: asyncio.Condition | None = field(default_factory=asyncio.Condition)
    _open: set[web.StreamResponse] = field(default_factory=set)

    # -- test-side API (any thread) ----------------------------------------------------------

    def set_slice(
        self, name: str, labels: dict[str, str], ports: dict[str, int],
        endpoints: list[tuple[str, bool]], annotations: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """Create or replace a slice; endpoints are (address, ready)."""
        obj = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "llm", "labels": labels,
                         "annotations": annotations or {}},
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
            "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in endpoints],
        }  # fmt: skip
        self._call(self._change, "MODIFIED" if name in self.slices else "ADDED", obj)

    def delete_slice(self, name: str) -> None:
        self._call(self._change, "DELETED", copy.deepcopy(self.slices[name]))

    def drop_watches(self) -> None:
        self._call(self._drop)

    def delete_unseen(self, name: str) -> None:
        """In one step on the server: drop every watch, delete the slice, forget history. The
        watchers missed the deletion and cannot resume (410 Gone): they must list again."""

        async def step() -> None:
            await self._drop()
            await self._change("DELETED", copy.deepcopy(self.slices[name]))
            self._compact()

        self._call(step)

    def compact(self) -> None:
        """Forget the history: every watch resumed from an older version gets 410 Gone."""
        self._call(self._compact)

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig.yaml"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{self.port}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, namespace: llm}}]\n"
            "current-context: fake\nusers: [{name: fake, user: {token: fake-token}}]\n"
        )
        return path

    # -- server side (its own loop) ----------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> None:
        assert self.loop is not None

        async def run() -> None:
            result = fn(*args)
            if asyncio.iscoroutine(result):
                await result

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    async def _change(self, kind: str, obj: dict[str, Any]) -> None:
        assert self._changed is not None
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        self.history.append((self.version, kind, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    async def _drop(self) -> None:
        for response in list(self._open):
            transport = response._req.transport if response._req is not None else None
            if transport is not None:
                transport.abort()
        self._open.clear()

    def _compact(self) -> None:
        self.history.clear()
        self.oldest = self.version + 1

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(PATH.replace("{namespace}", "{namespace}"), self._endpointslices)
        return app

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1", "True"):
            self.lists += 1
            items = [s for s in self.slices.values() if FakeKube._matches(s, selector)]
            return web.json_response({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.version)}, "items": items,
            })  # fmt: skip
        return await self._watch(request, selector)

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        assert self._changed is not None
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "True", "1")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self._open.add(response)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        try:
            if since < self.oldest - 1:
                self.gone_sent += 1
                await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "reason": "Expired", "code": 410,
                                     "message": f"too old resource version: {since}"})  # fmt: skip
                return response
            deadline = asyncio.get_running_loop().time() + timeout
            while asyncio.get_running_loop().time() < deadline:
                pending = [(v, k, o) for v, k, o in self.history if v > since]
                for version, kind, obj in pending:
                    since = version
                    if FakeKube._matches(obj, selector):
                        await send(kind, obj)
                if pending:
                    continue
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), BOOKMARK_EVERY_S)
                        continue
                    except TimeoutError:
                        pass
                if bookmarks:
                    # The version this watch has gone through, not the server's latest: a change
                    # made as the wait timed out (the condition's lock is taken back then) is
                    # still in the history and sent on the next pass, never marked as seen.
                    mark = {"resourceVersion": str(since)}
                    await send("BOOKMARK", {"kind": "EndpointSlice", "metadata": mark})
        except (ConnectionResetError, RuntimeError):
            pass  # dropped by drop_watches()
        finally:
            self._open.discard(response)
        return response


@contextmanager
def fake_endpoint_slices() -> Iterator[FakeEndpointSlices]:
    """Serve a FakeEndpointSlices on a free loopback port in a background thread."""
    kube = FakeEndpointSlices()
    server = ThreadedApp(kube.app(), kube.port, "fake-kube-api")
    kube.loop = server.loop
    with server:
        try:
            yield kube
        finally:
            server.call(kube._drop())
