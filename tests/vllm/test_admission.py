"""Admission under holds, on vLLM's real scheduler: it never waits for a lease.

vLLM 0.32's `Scheduler` with kvrelay's adapter runs in-process (`InProcessScheduler` of
`test_scheduler_retry`, 12 blocks); the test plays the model runner and the workers, whose only
part here is to echo the frees the connector orders (`reqs_to_free`) in `finished_sending`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.devtools import vllm_servers
from tests.vllm.test_scheduler_retry import InProcessScheduler

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


class EchoingScheduler(InProcessScheduler):
    """Each step hands the frees the connector ordered back as the workers would."""

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        meta = out.kv_connector_metadata.core
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7] if done else [])
        self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=set(meta.reqs_to_free) or None
                ),
            ),
        )
        return out

    def run(self, rid: str, steps: int = 50) -> None:
        for _ in range(steps):
            self.step()
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished():  # a held request stays until its free
                return
        raise AssertionError(f"{rid} did not finish")


@pytest.fixture
def scheduler(tiny_model: Path) -> Iterator[EchoingScheduler]:
    os.environ.setdefault("KVRELAY_CONNECTOR_SECRET", vllm_servers.CONNECTOR_SECRET)
    sched = EchoingScheduler(tiny_model)
    try:
        yield sched
    finally:
        sched.shutdown()


def _tokens(n: int, start: int) -> list[int]:
    return [start + i for i in range(n)]


def _held_blocks(scheduler: EchoingScheduler) -> int:
    return int(scheduler.sched.connector._sched.stats()["held_blocks"])


def test_a_turn_whose_history_is_cached_but_free_is_admitted_at_the_next_step(
    scheduler: EchoingScheduler,
) -> None:
    # 11 usable blocks. Another conversation's turn is held for its next turn: 6 blocks.
    scheduler.add("held", _tokens(170, 100), 8, {"hold_blocks": True})
    scheduler.run("held")
    assert _held_blocks(scheduler) == 6
    # This conversation's earlier turn, finished and not held: 3 cached blocks, free.
    history = _tokens(3 * vllm_servers.BLOCK_SIZE, 7000)
    scheduler.add("earlier", [*history, 1], 1)
    scheduler.run("earlier")
    pool = scheduler.sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 5
    # Its next turn: 6 blocks, 3 of them the cached history. The 5 free blocks include those
    # 3, so vLLM needs 6: the hold must go for it, now rather than at the hold's lease.
    scheduler.add("next", [*history, *_tokens(80, 9000)], 4)
    scheduler.step()  # asked, does not fit: the connector reclaims the hold
    out = scheduler.step()
    assert "next" in out.num_scheduled_tokens, "not admitted at the next step"
    assert _held_blocks(scheduler) == 0


def test_a_hold_shared_with_a_running_turn_is_not_reclaimed_for_nothing(
    scheduler: EchoingScheduler,
) -> None:
    history = _tokens(4 * vllm_servers.BLOCK_SIZE, 100)
    scheduler.add("held", history, 1, {"hold_blocks": True})
    scheduler.run("held")
    assert _held_blocks(scheduler) == 4
    # The conversation's next turn runs on the same engine (decode-only): its prefix hit is the
    # held blocks themselves, so freeing the hold gives no block back.
    scheduler.add("turn2", [*history, *_tokens(40, 5000)], 200)
    scheduler.step()
    scheduler.step()
    assert "turn2" in scheduler.sched.requests
    connector = scheduler.sched.connector
    # Under pressure vLLM asks whether a reclaim can spare a preemption: only if blocks come back.
    assert not connector.has_pending_block_frees()
    assert connector._sched.holds.take_frees() == [], "the hold was dropped, no block gained"
    assert _held_blocks(scheduler) == 4
