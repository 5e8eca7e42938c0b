"""How the engine talks to a KV connector: one small interface, two implementations.

`NoConnector` is the single-engine mode (no connector params; nothing is ever loaded or held).
`kvrelay.enginesim.nixl_host.NixlHost` wraps kvrelay's real connector (CONTRACTS §4). The engine
calls these methods in the order the connector's docstring defines; see `kvrelay.enginesim.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.enginesim.request import SimRequest


@dataclass
class ConnectorOutput:
    """What the connector reported this step (already passed to its scheduler side)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class KVHost(Protocol):
    """Engine-side handle on a KV connector (scheduler side plus this engine's worker)."""

    @property
    def enabled(self) -> bool: ...

    def get_num_new_matched_tokens(
        self, req: SimRequest, num_computed: int
    ) -> tuple[int, bool]: ...

    def update_state_after_alloc(
        self, req: SimRequest, block_ids: list[int], n_ext: int
    ) -> None: ...

    def start_step(self) -> None:
        """Build this step's metadata and hand it to the worker (starts reads, frees)."""

    def finish_step(self) -> ConnectorOutput:
        """Poll the worker (drives NIXL) and feed the result back to the scheduler side."""

    def loaded_tokens(self, req: SimRequest) -> int: ...

    def request_finished(
        self, req: SimRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]: ...

    def request_rejected(self, req: SimRequest) -> None: ...

    def reclaim_holds(self, num_blocks: int) -> int:
        """Ask for the oldest holds to be freed; returns how many blocks will come back."""

    def drop_agent(self) -> None:
        """Fault injection: lose this engine's NIXL agent (transfers then fail)."""

    def stats(self) -> dict[str, int]: ...

    def shutdown(self) -> None: ...


class NoConnector:
    """Single engine: kv_transfer_params are ignored and never returned."""

    @property
    def enabled(self) -> bool:
        return False

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, req: SimRequest, block_ids: list[int], n_ext: int) -> None:
        return None

    def start_step(self) -> None:
        return None

    def finish_step(self) -> ConnectorOutput:
        return ConnectorOutput()

    def loaded_tokens(self, req: SimRequest) -> int:
        return 0

    def request_finished(
        self, req: SimRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_rejected(self, req: SimRequest) -> None:
        return None

    def reclaim_holds(self, num_blocks: int) -> int:
        return 0

    def drop_agent(self) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}

    def shutdown(self) -> None:
        return None
