"""Scheduler decisions that need no transfer: thresholds, leg rules, aborts, policies."""

from __future__ import annotations

from collections.abc import Callable

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
    # Asked again (e.g. allocation retried): the same answer, no second plan.
    assert reader.get_num_new_matched_tokens(view, 4) == (4, True)
    reader.update_state_after_alloc(view, [[7, 8, 9]], 0)  # the engine decided not to load
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="release to reach the holder")


def test_abort_during_load_frees_only_after_the_read(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_load_failure_policy="fail")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _reader_view("r1", [*range(10), 99], params)
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    reader.update_state_after_alloc(view, [[7, 8, 9]], n)
    meta = reader.build_connector_meta()
    assert meta.reqs_to_recv["r1"].local_block_ids == (7, 8)
    assert meta.reqs_to_recv["r1"].remote_block_ids == (100, 101)
    # Aborted mid-read: the engine must keep the blocks NIXL writes into.
    assert reader.request_finished(view, [[7, 8, 9]]) == (True, None)
    assert reader.build_connector_meta().reqs_to_free == set()
    # The read fails (block 8 bad): policy fail reports it; then the blocks may be freed.
    reader.update_connector_output(set(), {"r1"}, {8})
    assert reader.failed_requests() == ["r1"] and reader.loaded_tokens("r1") == 4
    assert reader.build_connector_meta().reqs_to_free == {"r1"}
    holder.release_hold("h1")
    assert drain(holder) == {"h1"}


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
