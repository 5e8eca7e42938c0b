"""A tiny engine in its own process that drives the connector exactly like an engine would.

Tests and `bench.transfer` start holders and readers with `Peer.start(spec)` (multiprocessing
spawn, so each side has its own NIXL agents and side channel). The child runs an engine loop
thread (build metadata → every rank's `start_load_kv`/`get_finished` → `update_connector_output`
→ free blocks the workers report), and executes commands sent over a pipe inside that loop, so
the connector is only ever called from one "scheduler thread", as CONTRACTS §4 requires.

Each rank's caches are made as vLLM hands them to a connector (the attention backend's logical
shape, a permuted view where the physical order differs; with `block_major`, one buffer of
whole blocks and a strided view per layer into it, as vLLM's `BLHNC` layout) and registered
the way the vLLM adapter registers them (`prepare_caches`, then the worker), on the CPU or on a
CUDA device.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvrelay.devtools.ucx import with_loopback_ucx

SECRET = "test-connector-secret"


@dataclass
class PeerSpec:
    """Shape of one peer engine's KV caches and its connector settings."""

    engine_id: str
    tp_size: int = 1
    num_blocks: int = 64
    block_size: int = 16
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 8
    layout: str = "split"  # split | split_hnd | joint | mla | block_major
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # where the KV caches live: "cpu" or a CUDA device ("cuda", "cuda:1")
    ucx_tls: str = ""  # this peer's UCX transports; empty: the loopback default for its device

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _physical_shape(spec: PeerSpec) -> tuple[int, ...]:
    """Memory order of one layer's cache; `_vllm_view` gives the shape vLLM hands out."""
    heads = spec.num_heads // spec.tp_size
    nb, bs, hd = spec.num_blocks, spec.block_size, spec.head_dim
    if spec.layout == "split":  # FlashAttention: (2, blocks, block_size, heads, head_dim)
        return (2, nb, bs, heads, hd)
    if spec.layout == "split_hnd":  # the same shape over HND memory (heads outside tokens)
        return (2, nb, heads, bs, hd)
    if spec.layout == "joint":  # FlashInfer: (blocks, 2, block_size, heads, head_dim)
        return (nb, 2, bs, heads, hd)
    if spec.layout == "mla":  # one latent vector per token
        return (nb, bs, hd * spec.num_heads)
    if spec.layout == "block_major":  # BLHNC: one buffer, every layer's page inside each block
        return (nb, spec.num_layers, heads, bs, 2 * hd)
    raise ValueError(spec.layout)


def _vllm_view(physical: Any, layout: str) -> Any:
    """What vLLM hands a connector: the backend's logical shape, here a permuted view for HND."""
    return physical.permute(0, 1, 3, 2, 4) if layout == "split_hnd" else physical


class _Engine:
    """Child-process side: connector + block pool + loop."""

    def __init__(self, spec: PeerSpec, conn: Connection) -> None:
        import torch

        from kvrelay.connector import ConnectorConfig, ConnectorScheduler, ConnectorWorker
        from kvrelay.connector.tp import FinishedAggregator
        from kvrelay.connector.vllm.layout import prepare_caches

        self.torch = torch
        self.spec = spec
        self.conn = conn
        cfg: dict[str, Any] = {
            "engine_id": spec.engine_id,
            "secret": SECRET,
            "block_size": spec.block_size,
            "num_layers": spec.num_layers,
            "dtype": "float32",
            "model": "peer-test",
            "kv_layout": spec.layout,
            "use_mla": spec.layout == "mla",
            "tp_size": spec.tp_size,
        }
        cfg.update(spec.config)
        self.config = ConnectorConfig(**cfg)
        shape = _physical_shape(spec)
        heads = 1 if spec.layout == "mla" else spec.num_heads // spec.tp_size
        self.block_dim = 0
        self.caches: list[dict[str, Any]] = []
        self.workers = []
        for rank in range(spec.tp_size):
            # MLA ranks hold identical (replicated) KV, as real MLA engines do. Values are drawn
            # on the CPU (the same bytes on any device), then moved.
            gen = torch.Generator().manual_seed(
                spec.seed * 1000 + (0 if spec.layout == "mla" else rank)
            )
            if spec.layout == "block_major":
                # vLLM hands one strided view per layer into the shared buffer.
                buffer = torch.randn(shape, generator=gen, dtype=torch.float32).to(spec.device)
                handed = {f"layer{i}": buffer[:, i] for i in range(spec.num_layers)}
            else:
                handed = {
                    f"layer{i}": _vllm_view(
                        torch.randn(shape, generator=gen, dtype=torch.float32).to(spec.device),
                        spec.layout,
                    )
                    for i in range(spec.num_layers)
                }
            prepared = prepare_caches(
                handed, spec.num_blocks, spec.block_size, heads, name=spec.layout
            )
            worker = ConnectorWorker(self.config, rank, spec.tp_size)
            worker.register_kv_caches(prepared.tensors, prepared.layout)
            self.block_dim = prepared.layout.block_dim
            self.caches.append(prepared.tensors)
            self.workers.append(worker)
        self.sched = ConnectorScheduler(self.config)
        self.sched.start()
        self.sched.set_xfer_handshake_metadata(
            {w.rank: w.get_handshake_metadata() for w in self.workers}
        )
        # A request is done only when every rank reported it, in both directions.
        self.sent_agg = FinishedAggregator(spec.tp_size)
        self.recv_agg = FinishedAggregator(spec.tp_size)
        self.free_blocks = list(range(spec.num_blocks))
        self.req_blocks: dict[str, list[int]] = {}
        self.loads: dict[str, tuple[int, Any, int]] = {}  # rid -> (cid, view, n)
        self.polling = True
        self.freed_at: dict[str, float] = {}
        self.invalid_seen: set[int] = set()

    # --- blocks -----------------------------------------------------------------------------
    def alloc(self, rid: str, num_tokens: int, exact: list[int] | None = None) -> list[int]:
        if exact is not None:
            if not set(exact) <= set(self.free_blocks):
                raise RuntimeError("requested blocks are not free")
            self.free_blocks = [b for b in self.free_blocks if b not in exact]
            self.req_blocks[rid] = list(exact)
            return list(exact)
        n = max(1, math.ceil(num_tokens / self.spec.block_size))
        if n > len(self.free_blocks):
            raise RuntimeError("out of blocks")
        # Hand out blocks from the front; tests shuffle by holding some first.
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        self.req_blocks[rid] = blocks
        return blocks

    def free(self, rid: str) -> None:
        blocks = self.req_blocks.pop(rid, None)
        if blocks:
            self.free_blocks.extend(blocks)

    def block_data(self, block_ids: list[int]) -> list[list[Any]]:
        idx = self.torch.tensor(block_ids, dtype=self.torch.long, device=self.spec.device)
        return [
            [t.index_select(self.block_dim, idx).cpu().numpy() for t in caches.values()]
            for caches in self.caches
        ]

    # --- loop -------------------------------------------------------------------------------
    def step(self) -> None:
        meta = self.sched.build_connector_meta()
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for w in self.workers:
            w.start_load_kv(meta)
            if not self.polling:
                continue
            s, r = w.get_finished()
            sending |= self.sent_agg.add(w.rank, s)
            recving |= self.recv_agg.add(w.rank, r)
            invalid |= w.get_block_ids_with_load_errors()
        self.sched.update_connector_output(sending, recving, invalid)
        self.invalid_seen |= invalid
        for rid in sending:
            self.free(rid)
            self.freed_at[rid] = time.time()
        failed = set(self.sched.failed_requests())
        for rid in recving:
            if rid in self.loads:
                cid, _view, n = self.loads.pop(rid)
                loaded = self.sched.loaded_tokens(rid)
                self.reply(
                    cid,
                    {
                        "n": n,
                        "loaded": loaded,
                        "failed": rid in failed,
                        "invalid": sorted(self.invalid_seen & set(self.req_blocks.get(rid, []))),
                        "blocks": self.req_blocks.get(rid, []),
                    },
                )

    def reply(self, cid: int, value: Any) -> None:
        self.conn.send((cid, value))

    def handle(self, cid: int, cmd: str, args: dict[str, Any]) -> None:
        from kvrelay.connector import RequestView

        if cmd == "hold":
            rid = args["rid"]
            tokens = args["all_tokens"]
            blocks = self.alloc(rid, len(tokens), args.get("blocks"))
            view = RequestView(rid, args.get("client_rid"), args["prompt"], tokens, args["params"])
            delay, params = self.sched.request_finished(view, [blocks])
            if not delay:
                self.free(rid)
            self.reply(cid, {"params": params, "blocks": blocks})
        elif cmd == "load":
            rid = args["rid"]
            view = RequestView(rid, None, args["prompt"], args["prompt"], args["params"])
            n, _is_async = self.sched.get_num_new_matched_tokens(view, 0)
            blocks = self.alloc(rid, len(args["prompt"]))
            self.sched.update_state_after_alloc(view, [blocks], n)
            if n == 0:
                self.reply(
                    cid, {"n": 0, "loaded": 0, "failed": False, "invalid": [], "blocks": blocks}
                )
            else:
                self.loads[rid] = (cid, view, n)
        elif cmd == "finish":
            rid = args["rid"]
            view = RequestView(rid, None, args["prompt"], args["all_tokens"], args.get("params"))
            delay, params = self.sched.request_finished(view, [self.req_blocks.get(rid, [])])
            if not delay:
                self.free(rid)
            self.reply(cid, {"params": params})
        elif cmd == "reject":
            view = RequestView(args["rid"], None, args["prompt"], args["prompt"], args["params"])
            self.sched.request_rejected(view)
            self.reply(cid, True)
        elif cmd == "block_data":
            self.reply(cid, self.block_data(args["blocks"]))
        elif cmd == "stats":
            self.reply(
                cid,
                {
                    "sched": self.sched.stats(),
                    "workers": [w.stats() for w in self.workers],
                    "free_blocks": len(self.free_blocks),
                    "total_blocks": self.spec.num_blocks,
                },
            )
        elif cmd == "reclaim":
            self.reply(cid, self.sched.reclaim_holds(args["num_blocks"]))
        elif cmd == "release":
            self.reply(cid, self.sched.release_hold(args["rid"]))
        elif cmd == "free_all":
            # Finish every request this engine ran locally (not holds, not loads in flight).
            for rid in list(self.req_blocks):
                if not self.sched.holds.is_held(rid) and rid not in self.loads:
                    self.free(rid)
            self.reply(cid, True)
        elif cmd == "freed_at":
            self.reply(cid, self.freed_at.get(args["rid"]))
        elif cmd == "coalesce":
            for w in self.workers:
                w.config = w.config.model_copy(update={"coalesce": bool(args["on"])})
            self.reply(cid, True)
        elif cmd == "polling":
            self.polling = bool(args["on"])
            self.reply(cid, True)
        elif cmd == "info":
            self.reply(
                cid,
                {
                    "port": self.sched.side_channel_port,
                    "instance_id": self.sched.instance_id,
                    "compat_hash": self.config.compat_hash(),
                    "pid": os.getpid(),
                    "mem_type": self.workers[0].get_handshake_metadata()["layout"]["mem_type"],
                    "ucx": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
                },
            )
        else:
            self.reply(cid, RuntimeError(f"unknown command {cmd}"))

    def run(self) -> None:
        while True:
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg is None:
                    return
                cid, cmd, args = msg
                try:
                    self.handle(cid, cmd, args)
                except Exception as exc:
                    self.reply(cid, RuntimeError(f"{cmd}: {exc!r}\n{traceback.format_exc()}"))
            self.step()
            time.sleep(0.0005)  # engine step cadence, not synchronisation

    def close(self) -> None:
        self.sched.shutdown()
        for w in self.workers:
            w.shutdown()


def _peer_main(conn: Connection, spec: PeerSpec) -> None:
    if spec.ucx_tls:
        os.environ["UCX_TLS"] = spec.ucx_tls
    with_loopback_ucx(cuda=spec.on_cuda)
    try:
        engine = _Engine(spec, conn)
    except Exception:
        conn.send((0, RuntimeError(traceback.format_exc())))
        return
    conn.send((0, "ready"))
    try:
        engine.run()
    finally:
        engine.close()


class Peer:
    """Parent-side handle of a peer process."""

    def __init__(self, spec: PeerSpec) -> None:
        with_loopback_ucx()
        ctx = mp.get_context("spawn")
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, spec), daemon=True)
        self._next = 1
        self._replies: dict[int, Any] = {}
        self.info: dict[str, Any] = {}

    @classmethod
    def start(cls, spec: PeerSpec, timeout: float = 60.0) -> Peer:
        peer = cls(spec)
        peer.proc.start()
        try:
            ready = peer._wait(0, timeout)
            if ready != "ready":
                raise RuntimeError(f"peer {spec.engine_id} failed to start: {ready}")
            peer.info = peer.call("info")
        except BaseException:
            peer.kill()
            raise
        return peer

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def _wait(self, cid: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while cid not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or (not self.proc.is_alive() and not self._conn.poll(0)):
                raise TimeoutError(
                    f"peer {self.spec.engine_id}: no answer (alive={self.proc.is_alive()})"
                )
            if self._conn.poll(min(left, 0.2)):
                rcid, value = self._conn.recv()
                self._replies[rcid] = value
        value = self._replies.pop(cid)
        if isinstance(value, Exception):
            raise value
        return value

    def send(self, cmd: str, **args: Any) -> int:
        cid = self._next
        self._next += 1
        self._conn.send((cid, cmd, args))
        return cid

    def result(self, cid: int, timeout: float = 30.0) -> Any:
        return self._wait(cid, timeout)

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> Any:
        return self.result(self.send(cmd, **args), timeout)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(None)
            self.proc.join(15)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
