"""The generated shared-prefix workload: Mooncake-format requests whose reuse is prefixes
shared across requests (`bench/shared_prefix_workload.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import _trace as tr
from bench import shared_prefix_workload as spw


def test_groups_share_their_system_blocks_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "gsp.jsonl"
    assert spw.main(["--groups", "3", "--per-group", "4", "--rate", "2", "--out", str(out)]) == 0
    requests = tr.load_trace(out)  # the trace loader accepts every line
    assert len(requests) == 12
    assert all(r.input_length == 2048 + 128 and r.output_length == 256 for r in requests)
    systems = {r.hash_ids[:4] for r in requests}
    assert len(systems) == 3  # four 512-token blocks of the group's own
    assert len({r.hash_ids[4] for r in requests}) == 12  # each question its own block
    # Every request is a conversation of its own, its system prompt the shared blocks.
    plan = tr.reconstruct(requests)
    assert plan.conversations == 12
    # Each group's first request too sends the system prompt as a system message, so its
    # blocks are the ones the rest of its group reuses.
    assert all(t.system_end == 4 * tr.TRACE_BLOCK_TOKENS for t in plan.turns)
    # An LRU cache large enough reuses the system prompt of all but each group's first.
    bound = tr.lru_bound(requests, 100)
    assert bound["reused_tokens"] == 9 * 2048
    # Deterministic: the same parameters, byte for byte.
    again = tmp_path / "again.jsonl"
    spw.main(["--groups", "3", "--per-group", "4", "--rate", "2", "--out", str(again)])
    assert again.read_bytes() == out.read_bytes()
    times = [json.loads(line)["timestamp"] for line in out.read_text().splitlines()]
    assert times == sorted(times) and times[0] == 0


def test_a_system_prompt_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 512"):
        spw.generate(2, 2, 1000, 128, 256, 1.0, 0)
    with pytest.raises(ValueError):
        spw.generate(2, 2, 2048, 600, 256, 1.0, 0)


def test_the_committed_workload_is_the_generators_output(tmp_path: Path) -> None:
    # bench/workloads/shared_prefix.jsonl is what the comparison replays: regenerate it with
    # the parameters RESULTS.md names and compare byte for byte.
    committed = Path(spw.__file__).parent / "workloads" / "shared_prefix.jsonl"
    out = tmp_path / "again.jsonl"
    spw.main([
        "--groups", "16", "--per-group", "16", "--system-tokens", "8192",
        "--question-tokens", "256", "--output-tokens", "64", "--rate", "0.25", "--seed", "0",
        "--out", str(out),
    ])  # fmt: skip
    assert out.read_bytes() == committed.read_bytes()
