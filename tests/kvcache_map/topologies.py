"""Real multi-node Redis topologies on loopback for the map's tests: a 3-master Redis Cluster,
and a master + replica watched by three sentinels (Debian's `redis-server` runs all of them).

Every node is a `ServerProcess` (bounded readiness, stopped by `stop()`); set-up waits on the
cluster's or the sentinels' own view of the topology, never on a sleep.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import ServerProcess, free_port, tcp_ready, wait_until

SERVICE = "kvrelay-map"


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: run `make redis` (Debian: redis-server)")
    return binary


def cli(port: int, *args: str, timeout: float = 5.0) -> str:
    """One `redis-cli` command against 127.0.0.1:port; its output ('' when it fails)."""
    try:
        done = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout if done.returncode == 0 else ""


def _info(port: int, section: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in cli(port, "INFO", section).splitlines():
        name, sep, value = line.strip().partition(":")
        if sep:
            out[name] = value
    return out


@dataclass
class Node:
    """One redis-server process (data node or sentinel) on a free loopback port."""

    args: list[str]
    port: int = field(default_factory=free_port)
    process: ServerProcess | None = None
    # Its own directory: a replica's sync file must not be loaded by another node (or land in
    # the repository); a restarted node comes back empty, as a pod without persistence does.
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvrelay-rn-")))

    def start(self) -> Node:
        for stale in self.workdir.glob("*.rdb"):
            stale.unlink()
        argv = [_binary(), *self.args, "--port", str(self.port), "--bind", "127.0.0.1",
                "--protected-mode", "no", "--dir", str(self.workdir)]  # fmt: skip
        self.process = ServerProcess(
            argv, tcp_ready("127.0.0.1", self.port), name=f"redis-{self.port}", ready_timeout=15
        ).start()
        return self

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.stop()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RedisCluster:
    """Three masters, no replicas, all 16384 slots assigned."""

    nodes: list[Node] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvrelay-rc-")))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        """Start every node; on any failure the nodes started so far are stopped."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> RedisCluster:
        for i in range(3):
            node = Node([])
            node.args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / f"nodes-{i}.conf"),
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "2000",
                "--save", "", "--appendonly", "no",
            ]  # fmt: skip
            self.nodes.append(node.start())
        created = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}")
        for node in self.nodes:
            wait_until(
                lambda n=node: _info_cluster(n.port).get("cluster_state") == "ok",
                30, interval=0.1, what="the cluster to be ok on every node",
            )  # fmt: skip
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _info_cluster(port: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in cli(port, "CLUSTER", "INFO").splitlines():
        name, sep, value = line.strip().partition(":")
        if sep:
            out[name] = value
    return out


@dataclass
class SentinelSet:
    """A master, one replica and three sentinels (quorum 2) monitoring `SERVICE`."""

    master: Node = field(default_factory=lambda: Node(["--save", "", "--appendonly", "no"]))
    replica: Node | None = None
    sentinels: list[Node] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvrelay-rs-")))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> SentinelSet:
        """Start every node; on any failure the nodes started so far are stopped."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> SentinelSet:
        self.master.start()
        replica_args = ["--save", "", "--appendonly", "no", "--replicaof", "127.0.0.1"]
        self.replica = Node([*replica_args, str(self.master.port)]).start()
        replica = self.replica
        wait_until(
            lambda: _info(replica.port, "replication").get("master_link_status") == "up",
            30, interval=0.1, what="the replica to sync",
        )  # fmt: skip
        for i in range(3):
            conf = self.workdir / f"sentinel-{i}.conf"
            conf.write_text(
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(Node([str(conf), "--sentinel"]))
        for sentinel in self.sentinels:
            sentinel.start()
        for sentinel in self.sentinels:
            wait_until(
                lambda s=sentinel: self._sentinel_sees_all(s.port),
                60, interval=0.2, what="each sentinel to know the replica and the others",
            )  # fmt: skip
        return self

    @staticmethod
    def _sentinel_sees_all(port: int) -> bool:
        master = _sentinel_master(port)
        return master.get("num-slaves") == "1" and master.get("num-other-sentinels") == "2"

    def master_port(self) -> int | None:
        """The master's port as the first reachable sentinel reports it."""
        for sentinel in self.sentinels:
            out = cli(sentinel.port, "SENTINEL", "get-master-addr-by-name", SERVICE).split()
            if len(out) == 2:
                return int(out[1])
        return None

    def stop(self) -> None:
        for node in [*self.sentinels, self.master, *([self.replica] if self.replica else [])]:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _sentinel_master(port: int) -> dict[str, str]:
    lines = cli(port, "SENTINEL", "master", SERVICE).splitlines()
    return dict(zip(lines[0::2], lines[1::2], strict=False))
