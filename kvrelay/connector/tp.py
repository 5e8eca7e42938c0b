"""Tensor-parallel mapping between a reader rank and the holder's ranks. Torch-free.

Without MLA each rank holds a slice of the KV heads, so a reader rank reads the byte range of
its heads (needs head-major blocks when the TP sizes differ). With MLA the KV is replicated on
every rank: a reader rank reads ONE holder rank and only notifies the others, using the
holder's request id so they free too. Every read/notification message tells the holder rank
how many notifications to expect for the request, so the holder frees exactly when the last
expected reader is done.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind


class TPMismatchError(ConnectorError, ValueError):
    """The two engines' TP sizes or block geometries cannot be mapped onto each other."""

    kind = ConnectorErrorKind.TP_MISMATCH


@dataclass(frozen=True)
class ReadPiece:
    """Copy `length` bytes at `remote_offset` of a remote block region into `local_offset`."""

    remote_rank: int
    local_offset: int
    remote_offset: int
    length: int


@dataclass(frozen=True)
class ReadPlan:
    pieces: tuple[ReadPiece, ...]
    notify_only_ranks: tuple[int, ...]
    expected_per_holder_rank: int


def plan_reads(
    rank: int,
    tp_size: int,
    remote_tp_size: int,
    use_mla: bool,
    local_region_len: int,
    remote_region_len: int,
    head_major: bool,
) -> ReadPlan:
    """Which holder ranks reader `rank` reads (and which byte ranges), and whom it notifies."""
    if tp_size >= remote_tp_size:
        if tp_size % remote_tp_size:
            raise TPMismatchError(
                f"reader TP {tp_size} is not a multiple of holder TP {remote_tp_size}"
            )
        ratio = tp_size // remote_tp_size
        remote_rank = rank // ratio
        if use_mla or ratio == 1:
            if local_region_len != remote_region_len:
                raise TPMismatchError(
                    f"block region {local_region_len} B here vs {remote_region_len} B at holder"
                )
            piece = ReadPiece(remote_rank, 0, 0, local_region_len)
        else:
            if not head_major:
                raise TPMismatchError("heterogeneous TP without MLA needs a head-major layout")
            if local_region_len * ratio != remote_region_len:
                raise TPMismatchError(
                    f"block region {local_region_len} B x{ratio} != holder {remote_region_len} B"
                )
            piece = ReadPiece(remote_rank, 0, (rank % ratio) * local_region_len, local_region_len)
        return ReadPlan((piece,), (), ratio)

    if remote_tp_size % tp_size:
        raise TPMismatchError(
            f"holder TP {remote_tp_size} is not a multiple of reader TP {tp_size}"
        )
    ratio = remote_tp_size // tp_size
    group = list(range(rank * ratio, (rank + 1) * ratio))
    if use_mla:
        if local_region_len != remote_region_len:
            raise TPMismatchError(
                f"MLA block region {local_region_len} B here vs {remote_region_len} B at holder"
            )
        # Replicated KV: one read is enough; the rest of the group is told to free.
        return ReadPlan((ReadPiece(group[0], 0, 0, local_region_len),), tuple(group[1:]), 1)
    if not head_major:
        raise TPMismatchError("heterogeneous TP without MLA needs a head-major layout")
    if remote_region_len * ratio != local_region_len:
        raise TPMismatchError(
            f"holder block region {remote_region_len} B x{ratio} != local {local_region_len} B"
        )
    pieces = tuple(
        ReadPiece(r, i * remote_region_len, 0, remote_region_len) for i, r in enumerate(group)
    )
    return ReadPlan(pieces, (), 1)


@dataclass
class FinishedAggregator:
    """Combines per-rank `finished_sending` reports: a request is done when all ranks said so."""

    world_size: int
    _seen: dict[str, set[int]] = field(default_factory=dict)

    def add(self, rank: int, request_ids: Iterable[str]) -> set[str]:
        done: set[str] = set()
        for rid in request_ids:
            ranks = self._seen.setdefault(rid, set())
            ranks.add(rank)
            if len(ranks) >= self.world_size:
                del self._seen[rid]
                done.add(rid)
        return done
