"""The proxy-bound bench's judgement against a baseline tree: a ratio is within noise when the
baseline's own rounds in the same case moved at least as much."""

from __future__ import annotations

import math
from typing import Any

from bench import _proxybound


def case(target: str, rounds_rps: list[float], cpu: float = 100.0) -> dict[str, Any]:
    rounds = [{"rps": r, "router_cpu_us": cpu} for r in rounds_rps]
    median = sorted(rounds_rps)[len(rounds_rps) // 2]
    return {
        "mode": "non-stream", "concurrency": 64, "target": target, "rps": median,
        "router_cpu_us": cpu, "rounds": rounds,
    }  # fmt: skip


def test_round_spread_is_fastest_over_slowest_and_unknown_for_one_round() -> None:
    assert _proxybound.round_spread(case("x", [100, 125, 110])) == 1.25
    assert math.isnan(_proxybound.round_spread(case("x", [100])))


def test_within_noise_is_symmetric_around_one() -> None:
    assert _proxybound.within_noise(0.85, 1.2)
    assert _proxybound.within_noise(1.2, 1.2)
    assert not _proxybound.within_noise(0.8, 1.2)  # 1 / 1.2 = 0.833
    assert not _proxybound.within_noise(1.3, 1.2)
    assert not _proxybound.within_noise(1.0, math.nan)


def test_baseline_lines_judge_each_target_against_the_base_spread() -> None:
    data = {
        "baseline": "/tmp/base",
        "cases": [
            case(_proxybound.BASE, [100, 110, 105], cpu=100),
            case("kvrelay-w1", [98, 101, 99], cpu=110),  # 99 / 105 = 0.94: within 1.10
            case(_proxybound.WITHOUT, [80, 85, 82], cpu=90),  # 82 / 105 = 0.78: outside
        ],
    }
    text = "\n".join(_proxybound.baseline_lines(data))
    row = next(line for line in text.splitlines() if line.startswith("| non-stream c=64"))
    assert row.split(" | ")[1:] == ["1.10", "0.94x", "1.10x", "within", "0.78x", "0.90x",
                                    "OUTSIDE |"]  # fmt: skip
    assert "kvrelay-w1 req/s within noise of kvrelay-w1-base in 1 of 1 cases: met" in text
    assert "kvrelay-w1-without req/s within noise of kvrelay-w1-base in 0 of 1 cases: MISSED" in (
        text
    )
