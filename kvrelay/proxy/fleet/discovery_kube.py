"""Kubernetes discovery: watch EndpointSlices by label selector per role (`kubernetes_asyncio`).

For each role with a selector (`prefill_selector`, `decode_selector`) the proxy lists the
EndpointSlices matching it in `kube_namespace`, then watches them from the list's
resourceVersion (with bookmarks, so a quiet watch still advances its resourceVersion). Every
change sends the role's full set of *ready* endpoints to the fleet sync as its `kubernetes`
engines: ready endpoints join, endpoints that turn not-ready or disappear leave. A watch that
ends (server timeout, dropped connection) is resumed from the last resourceVersion; a 410 Gone
(the resourceVersion is too old) or any other error starts over with a fresh list.

Per slice, the engine port is the slice port named `kube_port_name` (default `http`, else the
slice's first port); the side channel is the port named `kube_side_channel_port_name`
(default `side-channel`, a Service port whose targetPort names the container port), or the
slice annotation `kvrelay.io/side-channel-port`.

Credentials: `kube_config` (a kubeconfig path) or the in-cluster service account. The chart
creates the Role (list/watch EndpointSlices) and RoleBinding when a selector is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvrelay.proxy.base import cancel_and_wait
from kvrelay.proxy.config import Settings
from kvrelay.proxy.fleet.discovery import Discovered, engine_url
from kvrelay.proxy.fleet.fleet_sync import FleetSync

log = logging.getLogger(__name__)

SIDE_CHANNEL_ANNOTATION = "kvrelay.io/side-channel-port"
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 240  # the server ends each watch after this; it is then resumed
RETRY_S = 1.0


def ready_engines(
    slices: dict[str, dict[str, Any]], port_name: str, side_name: str
) -> list[Discovered]:
    """Every ready endpoint of the slices, as engines (sorted, duplicates merged)."""
    out: dict[str, Discovered] = {}
    for item in slices.values():
        ports = {p.get("name") or "": p.get("port") for p in item.get("ports") or []}
        port = ports.get(port_name) or next(iter(ports.values()), None)
        if not isinstance(port, int):
            continue
        annotations = (item.get("metadata") or {}).get("annotations") or {}
        side = ports.get(side_name) or annotations.get(SIDE_CHANNEL_ANNOTATION)
        for endpoint in item.get("endpoints") or []:
            # `ready` unset means ready (API semantics); terminating endpoints are not ready.
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                url = engine_url(address, port)
                out[url] = Discovered(url, f"{address}:{side}" if side else None)
    return [out[url] for url in sorted(out)]


class _Gone(Exception):
    """410: the watch's resourceVersion is no longer available; list again."""


@dataclass(frozen=True)
class KubeScope:
    """What the watches of every role share: one API, one namespace, one fleet record to push
    to, and the EndpointSlice port names of the engines' HTTP port and side channel."""

    api: Any  # kubernetes_asyncio's DiscoveryV1Api (untyped)
    namespace: str
    sync: FleetSync
    port_name: str
    side_name: str


class KubeRoleWatch:
    """List + watch the EndpointSlices of one role (`selector`) in `scope`; push each changed
    ready set."""

    def __init__(self, scope: KubeScope, role: str, selector: str) -> None:
        self._scope = scope
        self._role = role
        self._selector = selector
        self._slices: dict[str, dict[str, Any]] = {}
        self._pushed: list[Discovered] | None = None
        self.version = ""  # the last resourceVersion seen (list, event or bookmark)
        self.synced = asyncio.Event()  # set after the first list has been applied

    async def run(self) -> None:
        while True:
            try:
                version = await self._list()
                while True:
                    try:
                        version = await self._watch(version)
                    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                        # Dropped mid-way: resume from the last version seen, no new list.
                        log.info("%s discovery: watch dropped, resuming", self._role)
                        version = self.version or version
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("%s discovery: resourceVersion expired (410), listing again", self._role)
            except Exception as exc:  # API server away or refusing: list again shortly
                log.warning("%s discovery: %s; retrying", self._role, _describe(exc))
                await asyncio.sleep(RETRY_S)

    async def _list(self) -> str:
        result = await self._scope.api.list_namespaced_endpoint_slice(
            self._scope.namespace, label_selector=self._selector, _preload_content=False
        )
        try:
            body = await result.json()
        finally:
            result.release()
        self._slices = {i["metadata"]["name"]: i for i in body.get("items") or []}
        await self._push()
        self.synced.set()
        self.version = str(body["metadata"]["resourceVersion"])
        return self.version

    async def _watch(self, version: str) -> str:
        """One watch from `version` until the server ends it; returns the last version."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        stream = watch.Watch()
        try:
            async with stream.stream(
                self._scope.api.list_namespaced_endpoint_slice,
                self._scope.namespace,
                label_selector=self._selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_S,
            ) as events:
                async for event in events:
                    obj = event["raw_object"]
                    version = obj["metadata"].get("resourceVersion") or version
                    self.version = version
                    kind = event["type"]
                    if kind in ("ADDED", "MODIFIED"):
                        self._slices[obj["metadata"]["name"]] = obj
                    elif kind == "DELETED":
                        self._slices.pop(obj["metadata"]["name"], None)
                    else:
                        continue  # BOOKMARK: only the version moves
                    await self._push()
        except ApiException as exc:
            if exc.status == 410:
                raise _Gone from exc
            raise
        return version

    async def _push(self) -> None:
        found = ready_engines(self._slices, self._scope.port_name, self._scope.side_name)
        if found == self._pushed:
            return
        await self._scope.sync.apply(
            {
                "op": "sync",
                "role": self._role,
                "source": "kubernetes",
                "urls": [d.url for d in found],
                "side_channels": {d.url: d.side_channel for d in found if d.side_channel},
            }
        )
        self._pushed = found
        log.info("%s discovery (kubernetes): %d ready engines", self._role, len(found))


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"{type(exc).__name__} {status}" if status else type(exc).__name__


class KubeDiscovery:
    """The role watches and the API client they share."""

    def __init__(self, api_client: Any, watches: list[KubeRoleWatch]) -> None:
        self._client = api_client
        self._watches = watches
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, first_sync_timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(w.run(), name="kvrelay-kube") for w in self._watches]
        # Start with the discovered engines when the API answers soon; otherwise the watches
        # keep trying in the background and the static engines serve meanwhile.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_sync_timeout):
                await asyncio.gather(*(w.synced.wait() for w in self._watches))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._client.close()


async def start_kube_discovery(settings: Settings, sync: FleetSync) -> KubeDiscovery | None:
    selectors = {"prefill": settings.prefill_selector, "decode": settings.decode_selector}
    if not any(selectors.values()):
        return None
    try:
        from kubernetes_asyncio import client, config
    except ImportError:  # pragma: no cover - the settings check names the extra
        raise RuntimeError(
            "Kubernetes discovery needs the `kubernetes` extra (pip install kvrelay[kubernetes])"
        ) from None
    if settings.kube_config:
        configuration = client.Configuration()
        await config.load_kube_config(
            config_file=settings.kube_config, client_configuration=configuration
        )
    else:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    namespace = settings.kube_namespace or _own_namespace()
    api_client = client.ApiClient(configuration)
    scope = KubeScope(
        client.DiscoveryV1Api(api_client),
        namespace,
        sync,
        settings.kube_port_name,
        settings.kube_side_channel_port_name,
    )
    watches = [
        KubeRoleWatch(scope, role, selector) for role, selector in selectors.items() if selector
    ]
    discovery = KubeDiscovery(api_client, watches)
    await discovery.start(first_sync_timeout=10.0)
    return discovery


def _own_namespace() -> str:
    try:
        return IN_CLUSTER_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
