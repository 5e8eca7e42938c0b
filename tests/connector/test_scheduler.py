"""Scheduler decisions that need no transfer: thresholds, leg rules, aborts, policies."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler
from tests.connector.sidechannel_helpers import drain, hold_params
from tests.harness import wait_until

MakeScheduler = Callable[..., ConnectorScheduler]


def _reader_view(rid: str, prompt: list[int], params: dict[str, object]) -> RequestView:
    return RequestView(
        rid, None, prompt, prompt, {**params, "do_remote_decode": True, "do_remote_prefill": False}
    )


def test_below_threshold_is_recomputed_and_the_holder_released(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_recompute_threshold=12)
    params = hold_params(holder, "h1", n_tokens=10)  # 2 full blocks of 4 = 8 tokens verifiable
    view = _reader_view("r1", [*range(10), 99], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (0, False)
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")
    assert holder.stats()["freed_by_release"] == 1 and reader.stats()["loads_skipped"] == 1


def test_whole_matching_blocks_only_and_local_prefix_counts(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (8, True)
    # Asked again (allocation retried) with a local hit: only the rest is loaded.
    assert reader.get_num_new_matched_tokens(view, 4) == (4, True)
    reader.update_state_after_alloc(view, [[7, 8, 9]], 0)  # the engine decided not to load
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")


def test_retried_ask_plans_the_read_from_the_new_local_hit(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=16)  # 4 full blocks: remote 100..103
    view = _reader_view("r1", [*range(16), 99, 98], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (16, True)
    # Allocation failed; on the retry the local prefix cache covers blocks 0 and 1.
    n, is_async = reader.get_num_new_matched_tokens(view, 8)
    assert (n, is_async) == (8, True)
    reader.update_state_after_alloc(view, [[10, 11, 12, 13, 14]], n)
    spec = reader.build_connector_meta().reqs_to_recv["r1"]
    # Tokens 8..15 land in the request's blocks 2 and 3, read from the holder's blocks 2, 3.
    assert (spec.local_block_ids, spec.remote_block_ids) == ((12, 13), (102, 103))
    reader.update_connector_output(set(), {"r1"}, set())
    assert reader.loaded_tokens("r1") == 16


def test_retry_whose_local_hit_covers_the_range_loads_nothing(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=16)
    view = _reader_view("r1", [*range(16), 99, 98], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (16, True)
    # vLLM asserts that an asynchronous load has tokens: never (0, True).
    assert reader.get_num_new_matched_tokens(view, 16) == (0, False)
    reader.update_state_after_alloc(view, [[10, 11, 12, 13, 14]], 0)
    assert reader.build_connector_meta().reqs_to_recv == {}
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")


@pytest.mark.parametrize("invalid", [set(), {7}], ids=["loaded", "load-failed"])
def test_a_request_loads_once_even_when_scheduled_again(
    make_scheduler: MakeScheduler, invalid: set[int]
) -> None:
    """Preempted after its load, or recomputing after a failed one, a request is asked
    again with nothing computed: its hold is consumed, so it must not load again (under
    policy `fail` a second, doomed load would error a correctly served request)."""
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_load_failure_policy="recompute")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    reader.update_state_after_alloc(view, [[7, 8, 9]], n)
    reader.build_connector_meta()
    reader.update_connector_output(set(), {"r1"}, invalid)
    assert reader.loaded_tokens("r1") == (0 if invalid else 8)

    assert reader.get_num_new_matched_tokens(view, 0) == (0, False)
    reader.update_state_after_alloc(view, [[4, 5, 6]], 0)
    assert reader.build_connector_meta().reqs_to_recv == {}
    assert reader.stats()["loads_started"] == 1


def test_abort_during_load_leaves_the_blocks_to_the_engine(make_scheduler: MakeScheduler) -> None:
    """vLLM keeps the blocks of a request finished mid-load until the load is reported in
    finished_recving, then forgets the request: reporting it in finished_sending as well
    would hit vLLM's `assert req_id in self.requests` and kill its engine core."""
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_load_failure_policy="fail")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    reader.update_state_after_alloc(view, [[7, 8, 9]], n)
    meta = reader.build_connector_meta()
    assert meta.reqs_to_recv["r1"].local_block_ids == (7, 8)
    assert meta.reqs_to_recv["r1"].remote_block_ids == (100, 101)

    assert reader.request_finished(view, [[7, 8, 9]]) == (False, None)
    # The read fails after the abort (block 8 bad): nothing to report, nothing to free.
    reader.update_connector_output(set(), {"r1"}, {8})
    assert reader.failed_requests() == [] and reader.loaded_tokens("r1") == 0
    for _ in range(3):
        assert reader.build_connector_meta().reqs_to_free == set()
    assert reader.stats()["loads_in_flight"] == 0
    holder.release_hold("h1")
    assert drain(holder) == {"h1"}


def test_load_without_room_still_ends_through_the_workers(make_scheduler: MakeScheduler) -> None:
    """Defensive: blocks too few for the planned read. The engine already waits for the
    load, so the workers report it finished-receiving with its blocks invalid."""
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_load_failure_policy="fail")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    reader.update_state_after_alloc(view, [[7]], n)  # 8 tokens need 2 blocks

    meta = reader.build_connector_meta()
    assert meta.reqs_to_recv == {} and meta.reqs_to_fail == {"r1": (7,)}
    reader.update_connector_output(set(), {"r1"}, {7})
    assert reader.failed_requests() == ["r1"] and reader.loaded_tokens("r1") == 0
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")


def test_release_racing_the_read_notification_frees_the_hold_once(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    params = hold_params(holder, "h1", n_tokens=10)
    assert holder.holds.claim("h1", "reader") is not None
    holder.build_connector_meta()  # step k: the workers run
    # Side-channel thread, mid-step: the claimer gives up just as its read completed.
    released = holder.holds.release("h1", params["release_token"], reader="reader")
    assert released.value == "released"
    # The workers report h1 freed by its reader's notification in step k.
    holder.update_connector_output({"h1"}, set(), set())
    assert holder.build_connector_meta().reqs_to_free == set()
    stats = holder.stats()
    assert stats["freed_by_release"] + stats["freed_by_read"] == 1 and stats["held"] == 0


def test_finished_without_ever_being_scheduled_releases_the_holder(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    # Aborted while waiting: the engine never asked how many tokens to load.
    assert reader.request_finished(view, [[]]) == (False, None)
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")
    assert holder.stats()["freed_by_release"] == 1


def test_invalid_blocks_reported_before_the_last_rank_finished_still_count(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    reader.update_state_after_alloc(view, [[7, 8, 9]], n)
    reader.build_connector_meta()
    # Rank 1 failed on block 7 in one step; rank 0 (and so the request) finished a step later.
    reader.update_connector_output(set(), set(), {7})
    reader.update_connector_output(set(), {"r1"}, set())
    assert reader.loaded_tokens("r1") == 0 and reader.failed_requests() == []  # recompute
    holder.release_hold("h1")
    assert drain(holder) == {"h1"}
