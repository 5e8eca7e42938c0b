"""enginesim stops, as vLLM's engine core does, when a connector breaks a scheduler invariant.

A scripted fake connector reports what each test needs; a connector that hands the engine an
id it does not expect, an asynchronous load of zero tokens, or a load that never ends must
stop the engine with `EngineInvariantError` instead of being quietly tolerated.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore, EngineInvariantError
from kvrelay.enginesim.kvhost import ConnectorOutput, NoConnector
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.tokenizer import get_tokenizer
from tests.harness import wait_until

TOK = get_tokenizer()


class FakeScriptedConnector(NoConnector):
    """Answers `get_num_new_matched_tokens` with `answer` and reports `outputs` in order;
    holds every finished request's blocks (delay_free) when `hold` is set."""

    def __init__(self, answer: tuple[int, bool] = (0, False), hold: bool = False) -> None:
        self.answer = answer
        self.hold = hold
        self.outputs: deque[ConnectorOutput] = deque()

    @property
    def enabled(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, req: SimRequest, num_computed: int) -> tuple[int, bool]:
        return self.answer

    def finish_step(self) -> ConnectorOutput:
        return self.outputs.popleft() if self.outputs else ConnectorOutput()

    def request_finished(
        self, req: SimRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.hold and block_ids:
            return True, {"remote_block_ids": [list(block_ids)]}
        return False, None


def _engine(kv: FakeScriptedConnector, **config: Any) -> tuple[EngineCore, list[Output]]:
    core = EngineCore(EngineConfig(block_size=4, **config), kv_host=kv)
    outputs: list[Output] = []
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    core.add_request(SimRequest(
        "r1", "r1", TOK.encode("a prompt with some history"),
        SamplingParams(max_tokens=2, ignore_eos=True), params, outputs.append,
    ))  # fmt: skip
    return core, outputs


def test_async_load_of_zero_tokens_stops_the_engine() -> None:
    core, _ = _engine(FakeScriptedConnector(answer=(0, True)))
    with pytest.raises(EngineInvariantError, match="asynchronous load of 0 tokens"):
        core.step()


def test_finished_recving_for_a_request_not_loading_stops_the_engine() -> None:
    kv = FakeScriptedConnector()
    core, _ = _engine(kv)
    kv.outputs.append(ConnectorOutput(finished_recving={"r1"}))  # r1 runs, it never loaded
    with pytest.raises(EngineInvariantError, match="not loading"):
        core.step()


def test_a_hold_reported_freed_twice_stops_the_engine() -> None:
    kv = FakeScriptedConnector(hold=True)
    core, outputs = _engine(kv)
    while not (outputs and outputs[-1].finished):
        core.step()
        core.deliver_outputs()
    assert "r1" in core.held
    kv.outputs.extend([ConnectorOutput(finished_sending={"r1"})] * 2)
    core.step()
    assert core.held == {}
    with pytest.raises(EngineInvariantError, match="holds no blocks"):
        core.step()


def test_unknown_finished_sending_stops_the_engine() -> None:
    kv = FakeScriptedConnector()
    core, _ = _engine(kv)
    kv.outputs.append(ConnectorOutput(finished_sending={"someone-else"}))
    with pytest.raises(EngineInvariantError, match="holds no blocks"):
        core.step()


def test_a_load_never_reported_finished_stops_the_engine() -> None:
    core, _ = _engine(FakeScriptedConnector(answer=(8, True)), remote_kv_wait_limit_s=0.2)
    core.step()
    assert "r1" in core.loading

    def step_raises() -> bool:
        try:
            core.step()
        except EngineInvariantError:
            return True
        return False

    wait_until(step_raises, 10, what="the engine to give up on the stuck load")
