"""Rounds of two configurations paired, round by round: the statistics `trace_compare.py` and
`paired_rounds.py` share (a round ran both configurations interleaved, minutes apart, so a
round's difference is the fair unit)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; past the table the
# normal's 1.96 is within 2%.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
LEVEL_POINTS = 0.005  # attainments this close (half a point: one request in 200) count as level


@dataclass(frozen=True)
class Pair:
    """One round of one run, at one rate: ours and the rival as measured side by side."""

    run: str  # the JSON file's name
    round: int
    rate: float
    ours_attainment: float
    rival_attainment: float
    ours_reuse: float


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its 95% interval; with one value the interval is
    unbounded (nothing is known of the spread)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, -math.inf, math.inf
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def label_in(runs: dict[str, Any], labels: Sequence[str]) -> str | None:
    """The first of `labels` that the run measured (a configuration renamed between runs is
    given under both names)."""
    return next((label for label in labels if label in runs), None)


def pairs_of(
    name: str, data: dict[str, Any], ours: Sequence[str], rival: Sequence[str]
) -> list[Pair]:
    """Every (round, rate) of one run where both configurations ran."""
    runs = data["runs"]
    mine, theirs = label_in(runs, ours), label_in(runs, rival)
    if mine is None or theirs is None:
        return []
    out = []
    for scale, our_rounds in runs[mine].items():
        their_rounds = runs[theirs].get(scale) or []
        for i, (a, b) in enumerate(zip(our_rounds, their_rounds, strict=False)):
            out.append(
                Pair(name, i, a["rate"], a["attainment"], b["attainment"], a["reuse_vs_lru"])
            )
    return out


class Round(NamedTuple):
    """One round of ours at one rate, whether or not the rival ran beside it."""

    run: str
    rate: float
    attainment: float
    reuse: float


def rounds_of(name: str, data: dict[str, Any], ours: Sequence[str]) -> list[Round]:
    """Every (round, rate) of ours in one run: its reuse needs no rival to be judged."""
    runs = data["runs"]
    mine = label_in(runs, ours)
    if mine is None:
        return []
    return [
        Round(name, r["rate"], r["attainment"], r["reuse_vs_lru"])
        for rounds in runs[mine].values()
        for r in rounds
    ]


AtRate = TypeVar("AtRate", Pair, Round)


def by_rate(pairs: Sequence[AtRate]) -> dict[float, list[AtRate]]:
    """Pairs (or ours' rounds) grouped by their rate (to the hundredth: the runs' rates agree
    that far)."""
    out: dict[float, list[AtRate]] = {}
    for p in pairs:
        out.setdefault(round(p.rate, 2), []).append(p)
    return out


def by_round(pairs: Sequence[Pair]) -> dict[tuple[str, int], dict[float, tuple[float, float]]]:
    """The pairs regrouped by round, (run, round) -> rate (to the hundredth, as `by_rate`) ->
    (ours' attainment, the rival's): a round's rates go together (they ran on the same
    machine minutes apart)."""
    out: dict[tuple[str, int], dict[float, tuple[float, float]]] = {}
    for p in pairs:
        out.setdefault((p.run, p.round), {})[round(p.rate, 2)] = (
            p.ours_attainment,
            p.rival_attainment,
        )
    return out


def differences(group: Sequence[Pair]) -> list[float]:
    """Ours' SLO attainment minus the rival's, pair by pair."""
    return [p.ours_attainment - p.rival_attainment for p in group]


def run_differences(group: Sequence[Pair]) -> list[float]:
    """Ours' SLO attainment minus the rival's, each run's mean over its rounds (in the order the
    runs first appear): a run's rounds share an hour of one host, whose load moves both sides
    of all of them, so they are not independent of each other, where runs are."""
    by_run: dict[str, list[float]] = {}
    for p in group:
        by_run.setdefault(p.run, []).append(p.ours_attainment - p.rival_attainment)
    return [statistics.fmean(diffs) for diffs in by_run.values()]


def signs(diffs: Sequence[float]) -> tuple[int, int, int]:
    """(above, level, below): differences past `LEVEL_POINTS` either way, and the rest."""
    above = sum(d > LEVEL_POINTS for d in diffs)
    below = sum(d < -LEVEL_POINTS for d in diffs)
    return above, len(diffs) - above - below, below


def points_cell(diffs: Sequence[float]) -> str:
    """The mean difference and its 95% interval, in points: "+0.1 (-0.8 to +1.0)"."""
    mean, low, high = mean_interval(diffs)
    return f"{mean * 100:+.1f} ({low * 100:+.1f} to {high * 100:+.1f})"


def within_slo(group: Sequence[Pair], slo_share: float) -> bool:
    """Ours met the SLO (`slo_share` of its requests) at this rate, on average over rounds."""
    return statistics.fmean(p.ours_attainment for p in group) >= slo_share


def attainment_verdict(diffs_by_rate: Mapping[float, Sequence[float]]) -> str:
    """met / MISSED / level for "ours' attainment never below the rival's", rate by rate."""
    lows = []
    for rate, diffs in sorted(diffs_by_rate.items()):
        _, low, high = mean_interval(diffs)
        if high < 0:
            return f"MISSED: below at {rate:.2f} req/s (interval up to {high * 100:+.1f} points)"
        lows.append(low)
    if all(low >= 0 for low in lows):
        return "met"
    return (
        "level: no difference these rounds can tell, ours at most "
        f"{-min(lows) * 100:.1f} points below at worst"
    )


def sign_test_p(above: int, below: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven between `above` and
    `below` (ties left out) were either side equally likely in each pair."""
    n, k = above + below, min(above, below)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)
    return min(1.0, 2 * tail)


def within_slo_signs(groups: Mapping[float, Sequence[Pair]], slo_share: float) -> str:
    """The pairs at every rate where ours met the SLO (`slo_share` of its requests) on average,
    counted together: where one rate's rounds are too few to tell, the rates within the SLO
    together may."""
    diffs = [
        d for group in groups.values() if within_slo(group, slo_share) for d in differences(group)
    ]
    above, level, below = signs(diffs)
    return (
        f"Every rate within the SLO together ({len(diffs)} pairs of a round and a rate): ours "
        f"above in {above}, level in {level}, below in {below}; sign test "
        f"(ties left out) p = {sign_test_p(above, below):.3f}."
    )
