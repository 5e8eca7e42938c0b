"""bench/kv_events_replay.py: a small fleet's replays read by one feed, measured."""

from __future__ import annotations

from bench import kv_events_replay


async def test_a_small_fleets_replays_are_all_learnt_and_measured() -> None:
    """Three publishers in the child process, 150 batches of 4 blocks each: every replay is
    answered without a gap, the index learns every block, and the figures are measured."""
    args = kv_events_replay.parse_args(
        ["--engines", "3", "--batches", "150", "--within-s", "30", "--no-results"]
    )
    with kv_events_replay.publishers(args, None) as endpoints:
        assert len(endpoints) == 3
        out = await kv_events_replay.measure(args, endpoints)
    assert out["replays"] == {"answered": 3.0, "short": 0.0, "timeout": 0.0}
    assert out["pairs"] == out["expected_pairs"] == 3 * 150 * 4
    assert out["cpu_s"] > 0 and out["wall_s"] > 0
    assert out["longest_stall_s"] >= out["p99_stall_s"] >= 0
