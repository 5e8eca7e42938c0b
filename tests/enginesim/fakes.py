"""Fakes for enginesim's core tests (named fake: no bytes move, only timing and block counts)."""

from __future__ import annotations

from kvrelay.enginesim.kvhost import ConnectorOutput, NoConnector
from kvrelay.enginesim.request import SimRequest


class FakeLoadingHost(NoConnector):
    """A fake connector: each request loads `n_ext` tokens from a remote engine, reported
    finished at the next step; records how many blocks each admitted request was given."""

    def __init__(self, n_ext: int) -> None:
        self.n_ext = n_ext
        self.started: set[str] = set()
        self.done: set[str] = set()
        self.alloc_blocks: list[int] = []

    @property
    def enabled(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> tuple[int, bool]:
        if req.request_id in self.done:
            return 0, False
        return self.n_ext, True

    def update_state_after_alloc(self, req: SimRequest, block_ids: list[int], n_ext: int) -> None:
        self.alloc_blocks.append(len(block_ids))
        if n_ext:
            self.started.add(req.request_id)

    def finish_step(self) -> ConnectorOutput:
        out = ConnectorOutput(finished_recving=set(self.started))
        self.done |= self.started
        self.started = set()
        return out

    def loaded_tokens(self, req: SimRequest) -> int:
        return self.n_ext


class ModelledClock:
    """A fake clock, the engine's time: every modelled wait advances it; nothing sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now
