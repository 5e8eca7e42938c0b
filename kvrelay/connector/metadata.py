"""Engine-facing value types and the per-step metadata the scheduler hands to every worker.

Plain dataclasses (picklable: an engine may ship them to worker processes). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.connector.protocol import HoldRef


@dataclass
class RequestView:
    """What the connector needs to know about one engine request."""

    request_id: str
    client_request_id: str | None
    prompt_token_ids: Sequence[int]
    all_token_ids: Sequence[int]
    kv_transfer_params: dict[str, Any] | None = None
    # The LoRA adapter the request runs with (None: the base model); it seeds block hashes.
    lora_name: str | None = None
    # The request's `cache_salt` (vLLM's per-tenant prefix-cache scope); it seeds them too.
    cache_salt: str | None = None


@dataclass(frozen=True)
class RecvSpec:
    """One pending read: local blocks to fill from a holder's blocks (same positions)."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    hold: HoldRef | None  # what frees the holder's blocks when this read gives up
    # Where `remote_block_ids` starts in the hold's block list: the claim must answer those
    # very blocks at those places.
    remote_first_block: int = 0


@dataclass
class ConnectorMetadata:
    """Built once per engine step by the scheduler; passed unchanged to every worker rank.

    `reqs_to_recv`: reads to start. `reqs_to_hold`: requests whose blocks this engine now
    holds for remote readers (workers count read notifications for them). `reqs_to_free`: held
    requests the scheduler released/expired/reclaimed; workers report them in
    `finished_sending` so the engine frees their blocks (the engine frees only through that),
    unless a worker already reported the request (its readers finished first).
    `reqs_to_fail`: loads that failed before any read started (the engine's blocks could not
    hold them); workers report them in `finished_recving` with these local blocks invalid.
    """

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_hold: dict[str, float] = field(default_factory=dict)
    reqs_to_free: set[str] = field(default_factory=set)
    reqs_to_fail: dict[str, tuple[int, ...]] = field(default_factory=dict)
