"""The reuse report a connector returns in its params: what it loaded, refused and found local.

Each test drives a reader scheduler through vLLM's hook order against a real holder's params
(block size 4) and checks the `kvr_*` fields of what `request_finished` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvrelay.connector.metadata import RequestView
from kvrelay.connector.protocol import (
    KVR_LOADED_TOKENS,
    KVR_LOCAL_HIT_TOKENS,
    KVR_OFFERED_BLOCKS,
    KVR_PROMPT_TOKENS,
    KVR_REFUSED_BLOCKS,
)
from kvrelay.connector.scheduler import ConnectorScheduler
from tests.connector.sidechannel_helpers import drain, hold_params
from tests.harness import wait_until

MakeScheduler = Callable[..., ConnectorScheduler]


def _view(rid: str, prompt: list[int], params: dict[str, Any]) -> RequestView:
    """P's request: pull the holder's blocks, keep its own for D."""
    return RequestView(
        rid, None, prompt, list(prompt),
        {**params, "do_remote_decode": True, "do_remote_prefill": False},
    )  # fmt: skip


def _finish(sched: ConnectorScheduler, view: RequestView) -> dict[str, Any]:
    """The request samples one token and finishes; returns the params its engine answers."""
    view.all_token_ids = [*view.prompt_token_ids, 7]
    blocks = list(range(10, 10 + len(view.all_token_ids) // 4 + 1))
    _, params = sched.request_finished(view, [blocks])
    assert params is not None
    return params


def _report(params: dict[str, Any]) -> tuple[int, int, int, int, dict[str, int]]:
    return (
        params[KVR_PROMPT_TOKENS], params[KVR_LOCAL_HIT_TOKENS], params[KVR_LOADED_TOKENS],
        params[KVR_OFFERED_BLOCKS], params[KVR_REFUSED_BLOCKS],
    )  # fmt: skip


def _load(sched: ConnectorScheduler, view: RequestView, local: int, invalid: bool = False) -> int:
    """Admission with `local` tokens found locally, then the read reported done."""
    n, is_async = sched.get_num_new_matched_tokens(view, local)
    assert is_async and n > 0
    sched.update_state_after_alloc(view, [[20, 21, 22, 23, 24]], n)
    spec = sched.build_connector_meta().reqs_to_recv[view.request_id]
    bad = {spec.local_block_ids[-1]} if invalid else set()
    sched.update_connector_output(set(), {view.request_id}, bad)
    return n


def test_loaded_tokens_and_local_hit_are_reported(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)  # offers 3 blocks: 2 full + a partial tail
    view = _view("r1", [*range(10), 99, 98], params)
    assert _load(reader, view, local=4) == 4  # block 0 local, block 1 loaded
    # The partial tail block of another request's KV cannot be verified: not loaded.
    assert _report(_finish(reader, view)) == (12, 4, 4, 3, {"local": 1, "partial": 1})


def test_rerendered_prompt_refuses_every_offered_block_by_hash(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    # The template re-rendered the first line: same history, different first token.
    view = _view("r1", [1000, *range(1, 10), 99, 98], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (0, False)
    reader.update_state_after_alloc(view, [[20, 21, 22, 23]], 0)
    _prompt, local, loaded, offered, refused = _report(_finish(reader, view))
    assert (loaded, local, offered) == (0, 0, 3)
    assert refused == {"hash": offered}
    wait_until(lambda: drain(holder) == {"h1"}, 10, what="the refused hold to be released")


def test_failed_read_reports_only_what_arrived(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    view = _view("r1", [*range(10), 99, 98], params)
    _load(reader, view, local=0, invalid=True)  # the second loaded block arrived damaged
    assert _report(_finish(reader, view)) == (12, 0, 4, 3, {"failed": 1, "partial": 1})


def test_load_under_threshold_is_refused_as_such(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader", kv_recompute_threshold=12)
    params = hold_params(holder, "h1", n_tokens=10)
    view = _view("r1", [*range(10), 99, 98], params)
    assert reader.get_num_new_matched_tokens(view, 0) == (0, False)
    reader.update_state_after_alloc(view, [[20, 21, 22, 23]], 0)
    assert _report(_finish(reader, view)) == (12, 0, 0, 3, {"partial": 1, "threshold": 2})


def test_same_request_leg_loads_the_verified_tail(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    params = hold_params(holder, "h1", n_tokens=10)
    # D's leg of the request P served: the same prompt, P's partial tail matches.
    view = RequestView(
        "d1", None, list(range(10)), list(range(10)),
        {**params, "do_remote_prefill": True, "hold_blocks": True},
    )  # fmt: skip
    assert _load(reader, view, local=0) == 9  # the last prompt token is always computed
    assert _report(_finish(reader, view)) == (10, 0, 9, 3, {})


def test_decode_only_turn_reports_the_engines_local_hit(make_scheduler: MakeScheduler) -> None:
    reader = make_scheduler(engine_id="decode")
    view = RequestView("d2", None, list(range(21)), list(range(21)), {"hold_blocks": True})
    assert reader.get_num_new_matched_tokens(view, 16) == (0, False)
    reader.update_state_after_alloc(view, [[1, 2, 3, 4, 5, 6]], 0)
    assert _report(_finish(reader, view)) == (21, 16, 0, 0, {})


@pytest.mark.parametrize("local", [0, 8])
def test_local_hit_is_the_one_of_the_first_admission(
    make_scheduler: MakeScheduler, local: int
) -> None:
    reader = make_scheduler(engine_id="decode")
    view = RequestView("d3", None, list(range(21)), list(range(21)), {"hold_blocks": True})
    reader.get_num_new_matched_tokens(view, 16)  # allocation failed: asked again below
    reader.get_num_new_matched_tokens(view, local)
    reader.update_state_after_alloc(view, [[1, 2, 3, 4, 5, 6]], 0)
    # Preempted and re-admitted with whatever the cache holds then: the first prefill stands.
    reader.get_num_new_matched_tokens(view, 20)
    reader.update_state_after_alloc(view, [[1, 2, 3, 4, 5, 6]], 0)
    assert _report(_finish(reader, view))[1] == local


def test_no_report_is_kept_after_the_request_ends(make_scheduler: MakeScheduler) -> None:
    reader = make_scheduler(engine_id="decode")
    for i in range(3):
        view = RequestView(f"a{i}", None, list(range(9)), list(range(9)), {"hold_blocks": True})
        reader.get_num_new_matched_tokens(view, 0)
        if i == 0:
            reader.request_rejected(view)
        else:
            reader.request_finished(view, [[1, 2, 3]] if i == 1 else [])
    assert reader._reports == {}
