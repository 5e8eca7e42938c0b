"""One NIXL agent (UCX backend): registration, descriptor lists, READ + notification, polling.

The only module that talks to nixl. Progress is driven by the caller polling (`state`,
`notifications`) — no progress thread — and every NIXL error surfaces as `TransportError`
(NIXL's exceptions share no base class).

Two ways to name what a READ moves. Prepared lists (`prepare`, `read_prepared`): every
(strip, block) of a cache is one descriptor of a list NIXL prepares once per side (this agent's
own, and each holder's when its agent is added), handed to NIXL as one strided row per strip,
so a read passes two arrays of indices and nothing per descriptor is built in Python; NIXL
merges descriptors adjacent on both sides itself. Built lists (`build_descs`, `read`): the
rows of one read made in Python, contiguous runs of blocks as one row when coalescing is on;
what a read that moves a slice of each block (heterogeneous TP) needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch  # nixl needs torch imported first

from kvrelay.connector.block_runs import block_runs
from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.layout import CacheGeometry, Strip
from kvrelay.connector.tp import ReadPiece

log = logging.getLogger(__name__)

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - the connector extra is required for the worker
    nixl_agent = None
    nixl_agent_config = None


class TransportError(ConnectorError, RuntimeError):
    """Any NIXL failure (registration, metadata, transfer posting or state).

    `pending_handle`: a posted transfer whose handle NIXL refused to release; the caller keeps
    it (and the blocks it may still write into) until a release succeeds.
    """

    kind = ConnectorErrorKind.TRANSPORT

    def __init__(self, message: str, pending_handle: Any = None) -> None:
        super().__init__(message)
        self.pending_handle = pending_handle


XferHandle = Any
PreparedList = Any  # nixl's prepared descriptor list handle


def _strip_runs(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    mergeable: bool,
) -> Iterator[tuple[Strip, Strip, list[tuple[int, int, int]]]]:
    """Each strip pair of a read (the layouts must have as many strips) and its runs of
    blocks, one descriptor each: blocks adjacent on both sides merge where `mergeable` and the
    strip's blocks lie end to end on both sides."""
    if len(local.strips) != len(remote.strips):
        raise TransportError(
            f"layout mismatch: {len(local.strips)} block strips here, "
            f"{len(remote.strips)} at the holder"
        )
    merged = block_runs(local_blocks, remote_blocks, mergeable)
    single: list[tuple[int, int, int]] | None = None
    for ls, rs in zip(local.strips, remote.strips, strict=True):
        if ls.block_stride == ls.region_len and rs.block_stride == rs.region_len:
            yield ls, rs, merged
        else:
            if single is None:
                single = block_runs(local_blocks, remote_blocks, False)
            yield ls, rs, single


def build_descs(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    piece: ReadPiece,
    coalesce: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, dev) arrays for one read piece over every strip, same order both sides."""
    # Whole-region pieces over adjacent blocks may merge; sliced pieces never can.
    whole = piece.length == local.region_len == remote.region_len
    rows_l: list[tuple[int, int, int]] = []
    rows_r: list[tuple[int, int, int]] = []
    strips = _strip_runs(local, remote, local_blocks, remote_blocks, coalesce and whole)
    for ls, rs, runs in strips:
        for lb, rb, n in runs:
            rows_l.append(
                (
                    ls.base_addr + lb * ls.block_stride + piece.local_offset,
                    n * piece.length,
                    local.device_id,
                )
            )
            rows_r.append(
                (
                    rs.base_addr + rb * rs.block_stride + piece.remote_offset,
                    n * piece.length,
                    remote.device_id,
                )
            )
    return np.array(rows_l, dtype=np.uint64), np.array(rows_r, dtype=np.uint64)


def merged_descs(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> int:
    """The descriptors a whole-block read over a prepared list takes once NIXL has merged the
    blocks adjacent on both sides: as many as `build_descs` would build with coalescing on.
    Raises `TransportError` when the layouts' strips differ in number."""
    strips = _strip_runs(local, remote, local_blocks, remote_blocks, True)
    return sum(len(runs) for _, _, runs in strips)


def block_indices(num_strips: int, num_blocks: int, blocks: Sequence[int]) -> np.ndarray:
    """Indices of `blocks` in every strip of a prepared list of `num_blocks` blocks per strip,
    strip by strip (the order both sides of a read share)."""
    base = np.arange(num_strips, dtype=np.int64)[:, None] * num_blocks
    return (base + np.asarray(blocks, dtype=np.int64)[None, :]).ravel().astype(np.int32)


class NixlTransport:
    """A NIXL agent with the engine's KV caches registered."""

    def __init__(self, agent_name: str, threads: int = 0) -> None:
        """`threads`: UCX worker threads of the agent (0: UCX's own progress on the caller's
        polls only)."""
        if nixl_agent is None or nixl_agent_config is None:
            raise TransportError("nixl is not installed (install kvrelay[connector])")
        assert torch is not None
        self.name = agent_name
        try:
            config = nixl_agent_config(
                enable_prog_thread=False, backends=["UCX"], num_threads=threads
            )
            self._agent = nixl_agent(agent_name, config)
        except Exception as exc:  # NIXL raises assorted types
            raise TransportError(f"cannot create NIXL agent: {exc}") from exc
        self._reg: Any = None
        self._mem_type = "DRAM"

    def register(self, tensors: Sequence[torch.Tensor], mem_type: str) -> None:
        try:
            self._reg = self._agent.register_memory(list(tensors))
        except Exception as exc:
            raise TransportError(f"cannot register KV caches with NIXL: {exc}") from exc
        self._mem_type = mem_type

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception as exc:
            raise TransportError(f"cannot load remote agent metadata: {exc}") from exc

    def remove_remote(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:  # already gone: nothing to undo
            log.debug("remove_remote_agent(%s) failed: %s", agent_name, exc)

    def read(
        self, remote_agent: str, local: np.ndarray, remote: np.ndarray, notif: bytes
    ) -> XferHandle:
        """Post a READ of `remote` into `local`; the holder gets `notif` when it is done."""
        agent = self._agent

        def make() -> XferHandle:
            local_descs = agent.get_xfer_descs(local, self._mem_type)
            remote_descs = agent.get_xfer_descs(remote, self._mem_type)
            return agent.initialize_xfer("READ", local_descs, remote_descs, remote_agent, notif)

        return self._post(remote_agent, make)

    def prepare(self, geometry: CacheGeometry, remote_agent: str | None = None) -> PreparedList:
        """Every (strip, block) of `geometry` as one prepared descriptor list, in which strip
        `s`'s block `b` is index `s * geometry.num_blocks + b` (`block_indices`). `remote_agent`:
        the holder whose memory `geometry` describes; None: this agent's own caches."""
        rows = np.array(
            [
                (s.base_addr, s.region_len, geometry.device_id, s.block_stride, geometry.num_blocks)
                for s in geometry.strips
            ],
            dtype=np.uint64,
        )
        try:
            return self._agent.prep_xfer_dlist(
                remote_agent or "NIXL_INIT_AGENT", rows, geometry.mem_type
            )
        except Exception as exc:
            raise TransportError(f"cannot prepare a descriptor list: {exc}") from exc

    def drop_prepared(self, prepared: PreparedList) -> None:
        """Free a prepared list (before its remote agent is removed)."""
        try:
            self._agent.release_dlist_handle(prepared)
        except Exception as exc:  # already gone with its agent: nothing to undo
            log.debug("release_dlist_handle failed: %s", exc)

    def read_prepared(
        self,
        remote_agent: str,
        local: PreparedList,
        local_indices: np.ndarray,
        remote: PreparedList,
        remote_indices: np.ndarray,
        notif: bytes,
    ) -> XferHandle:
        """Post a READ of the remote list's `remote_indices` into the local list's
        `local_indices` (pairwise); the holder gets `notif` when it is done."""
        agent = self._agent

        def make() -> XferHandle:
            return agent.make_prepped_xfer(
                "READ", local, local_indices, remote, remote_indices, notif
            )

        return self._post(remote_agent, make)

    def _post(self, remote_agent: str, make: Callable[[], XferHandle]) -> XferHandle:
        """Make a transfer (`make`) and post it; a post NIXL fails is released, or kept in the
        error when NIXL will not let go of it."""
        try:
            handle = make()
            status = self._agent.transfer(handle)
        except Exception as exc:
            raise TransportError(f"cannot post READ to {remote_agent}: {exc}") from exc
        if status == "ERR":
            kept = None if self.release(handle) else handle
            raise TransportError(f"READ to {remote_agent} failed at post", pending_handle=kept)
        return handle

    def state(self, handle: XferHandle) -> str:
        """'DONE', 'PROC' or 'ERR' (also drives UCX progress)."""
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception as exc:
            log.debug("check_xfer_state failed: %s", exc)
            return "ERR"

    def release(self, handle: XferHandle) -> bool:
        """Whether NIXL let go of the handle. A refusal does not prove the DMA stopped: the
        caller keeps the handle and its blocks and tries again later."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("release_xfer_handle failed (handle and blocks kept): %s", exc)
            return False
        return True

    def notify(self, remote_agent: str, message: bytes) -> None:
        try:
            self._agent.send_notif(remote_agent, message)
        except Exception as exc:
            raise TransportError(f"cannot notify {remote_agent}: {exc}") from exc

    def notifications(self) -> dict[str, list[bytes]]:
        try:
            notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        except Exception as exc:
            log.debug("get_new_notifs failed: %s", exc)
            return {}
        return notifs

    def close(self) -> None:
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("deregister_memory failed: %s", exc)
            self._reg = None
