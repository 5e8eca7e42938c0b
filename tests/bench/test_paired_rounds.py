"""Rounds paired over trace comparison runs (`bench/_paired.py`, `bench/paired_rounds.py` and the
paired line of `trace_compare.py`'s verdicts): which rounds pair, the mean's interval, goodput
signs from bounds, the sign test, and the verdict on "never below"."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import _paired
from bench import paired_rounds as pr
from bench import trace_compare as tc

OURS, RIVAL = "kvrelay default (2P+6D)", "kvrelay holds off (2P+6D)"


def run_data(by_label: dict[str, dict[str, list[tuple[float, float]]]]) -> dict[str, Any]:
    """A trace_compare JSON's `runs`: label -> scale -> rounds of (attainment, reuse)."""
    rates = {"48.0": 9.2, "72.0": 13.8}
    return {
        "runs": {
            label: {
                scale: [
                    {"rate": rates[scale], "attainment": a, "reuse_vs_lru": r} for a, r in rounds
                ]
                for scale, rounds in by_scale.items()
            }
            for label, by_scale in by_label.items()
        }
    }


def written(folder: Path, runs: dict[str, dict[str, Any]]) -> list[str]:
    """Each run's JSON written to `folder` under its file name: the paths, in order."""
    paths = []
    for name, data in runs.items():
        (folder / name).write_text(json.dumps(data))
        paths.append(str(folder / name))
    return paths


def test_rounds_pair_only_where_both_ran_and_under_either_name() -> None:
    data = run_data({
        "kvrelay old name": {"48.0": [(0.92, 0.9), (0.91, 0.95)]},
        RIVAL: {"48.0": [(0.90, 0.8), (0.93, 0.8), (0.5, 0.5)], "72.0": [(0.8, 0.8)]},
        "aggregated": {"48.0": [(0.1, 0.1)]},
    })  # fmt: skip
    pairs = _paired.pairs_of("r.json", data, [OURS, "kvrelay old name"], [RIVAL])
    # Two rounds at 48x (the rival's third has no partner), none at 72x (ours did not run it).
    assert [(p.round, p.rate) for p in pairs] == [(0, 9.2), (1, 9.2)]
    assert pairs[0].ours_attainment == 0.92 and pairs[0].rival_attainment == 0.90
    assert pairs[1].ours_reuse == 0.95
    assert _paired.pairs_of("r.json", data, [OURS], [RIVAL]) == []


def test_mean_interval_is_students_t_and_unbounded_for_one_value() -> None:
    mean, low, high = _paired.mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert high - mean == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert low == pytest.approx(2 * mean - high)
    assert _paired.mean_interval([5.0])[1:] == (-math.inf, math.inf)
    assert _paired.t975(1) == 12.706 and _paired.t975(200) == 1.96


@pytest.mark.parametrize(
    ("ours", "rival", "sign"),
    [
        ("10.50", "9.50", "above"),
        ("9.50", "10.50", "below"),
        ("9.50", "9.50", "level"),
        (">= 13.80", "12.00", "above"),
        (">= 9.20", "< 9.20", "above"),  # at least 9.20 against under 9.20
        ("< 9.20", ">= 9.20", "below"),
        ("< 9.20", "< 9.20", "unknown"),
        (">= 13.80", ">= 13.80", "unknown"),
        ("< 9.20", "5.00", "unknown"),  # anywhere in [0, 9.20)
        (">= 9.20", "9.20", "unknown"),  # at least level: above or level
    ],
)
def test_goodput_sign_from_each_rounds_bounds(ours: str, rival: str, sign: str) -> None:
    def one(label: str) -> tc.Goodput:
        value = 0.0 if label.startswith("<") else float(label.removeprefix(">= "))
        return tc.Goodput((value,), (label,))

    assert pr.goodput_sign(one(ours), one(rival)) == sign


def test_verdict_missed_when_every_round_is_below_level_when_mixed_met_when_above() -> None:
    below = {9.2: [-0.03, -0.04, -0.02, -0.03]}
    assert _paired.attainment_verdict(below).startswith("MISSED: below at 9.20")
    mixed = {9.2: [0.02, -0.02, 0.0, 0.01], 13.8: [0.0, 0.01, -0.01]}
    assert _paired.attainment_verdict(mixed).startswith("level")
    above = {9.2: [0.02, 0.03, 0.02], 13.8: [0.01, 0.015, 0.012]}
    assert _paired.attainment_verdict(above) == "met"


def _pairs(by_run: dict[str, list[float]]) -> list[_paired.Pair]:
    """Pairs at 9.20 req/s with these differences, run by run."""
    return [
        _paired.Pair(run, i, 9.2, 0.9 + d, 0.9, 0.95)
        for run, diffs in by_run.items()
        for i, d in enumerate(diffs)
    ]


def test_runs_are_the_unit_of_the_second_interval() -> None:
    """Seven rounds mostly below, but one of the three runs level: as independent rounds the
    interval lies below zero (MISSED); with each run's mean the unit (three values, Student's t
    with two degrees of freedom) it cannot tell. Three runs each clearly below are MISSED
    either way."""
    pairs = _pairs({"a": [-0.05, -0.06, -0.05], "b": [-0.04, -0.05], "c": [0.01, 0.0]})
    by_run = _paired.run_differences(pairs)
    assert by_run == pytest.approx([-0.16 / 3, -0.045, 0.005])
    assert _paired.attainment_verdict({9.2: _paired.differences(pairs)}).startswith("MISSED")
    assert _paired.attainment_verdict({9.2: by_run}).startswith("level")
    below = _pairs({"a": [-0.05, -0.06], "b": [-0.05, -0.04], "c": [-0.05, -0.05]})
    assert _paired.attainment_verdict({9.2: _paired.run_differences(below)}).startswith("MISSED")


def test_main_pools_files_and_judges_reuse_only_within_the_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = run_data({
        OURS: {"48.0": [(0.92, 0.95), (0.91, 0.93)], "72.0": [(0.85, 0.7), (0.86, 0.7)]},
        RIVAL: {"48.0": [(0.90, 0.9), (0.92, 0.9)], "72.0": [(0.85, 0.7), (0.87, 0.7)]},
    })  # fmt: skip
    b = run_data({
        OURS: {"48.0": [(0.93, 0.94)], "72.0": [(0.84, 0.7)]},
        RIVAL: {"48.0": [(0.91, 0.9)], "72.0": [(0.83, 0.7)]},
    })  # fmt: skip
    paths = written(tmp_path, {"a.json": a, "b.json": b})
    assert pr.main(["--ours", OURS, "--rival", RIVAL, *paths]) == 0
    out = capsys.readouterr().out
    assert "| 9.20 | 3 (2) |" in out
    # Over runs: a's mean (+0.5: +2 and -1) and b's (+2.0), two values, t with one degree.
    row = next(line for line in out.splitlines() if line.startswith("| 9.20 |"))
    assert row.split(" | ")[3] == "+1.3 (-8.3 to +10.8)"
    assert "(SLO attainment, runs as the unit): level" in out
    assert "ours' reuse at 9.20 req/s, mean over rounds" in out and "-> met" in out
    assert "13.80 req/s" in out and "not judged" in out  # 85% of requests: outside the SLO
    # Within the SLO (9.20 only): +2, -2 and +2 points: above twice, below once.
    assert "(3 pairs of a round and a rate): ours above in 2, level in 0, below in 1" in out
    # Both curves cross between 9.20 and 13.80: the pooled goodput's line, with its verdict.
    pooled = next(line for line in out.splitlines() if "paired rounds' mean curves" in line)
    assert pooled.startswith("- goodput of the 3 paired rounds' mean curves")
    assert pooled.endswith("(aim: ours never below the rival)")
    with pytest.raises(SystemExit, match="no run measured both"):
        pr.main(["--ours", "nobody", "--rival", RIVAL, *paths])


def test_sign_test_is_exact_binomial_two_sided() -> None:
    assert _paired.sign_test_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert _paired.sign_test_p(3, 3) == 1.0
    assert _paired.sign_test_p(0, 0) == 1.0
    assert _paired.sign_test_p(0, 6) == pytest.approx(2 / 64)


def test_trace_compare_verdicts_add_the_paired_line_against_holds_off() -> None:
    runs = run_data({
        OURS: {"48.0": [(0.88, 0.9), (0.87, 0.9), (0.89, 0.9)], "72.0": [(0.8, 0.9)] * 3},
        RIVAL: {"48.0": [(0.91, 0.9), (0.90, 0.9), (0.92, 0.9)], "72.0": [(0.82, 0.9)] * 3},
    })["runs"]  # fmt: skip
    line = tc.paired_line(runs, OURS, RIVAL)
    assert len(line) == 1
    assert "9.20 req/s -3.0 (" in line[0] and "13.80 req/s -2.0 (" in line[0]
    assert "-> MISSED: below at" in line[0]
    one_round = {label: {s: r[:1] for s, r in by.items()} for label, by in runs.items()}
    assert tc.paired_line(one_round, OURS, RIVAL) == []  # no spread to judge by
    configs = {label: tc._config_of(label, 8) for label in (OURS, RIVAL)}
    gps = tc.goodputs_of({"runs": runs})
    rows = {
        label: {float(scale): {"attainment": r[0]["attainment"], "reuse_vs_lru": 0.9,
                               "d_pinned_unused": 0.0} for scale, r in by.items()}
        for label, by in runs.items()
    }  # fmt: skip
    lines = tc.verdicts(rows, gps, configs, runs=runs)
    assert any("paired round by round" in x for x in lines)
    assert not any("paired round by round" in x for x in tc.verdicts(rows, gps, configs))


def test_ours_alone_counts_for_its_reuse_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = run_data({
        OURS: {"48.0": [(0.92, 0.95), (0.91, 0.88)]},
        RIVAL: {"48.0": [(0.90, 0.9), (0.92, 0.9)]},
    })  # fmt: skip
    alone = run_data({
        OURS: {"48.0": [(0.93, 0.96), (0.94, 0.97), (0.93, 0.95), (0.92, 0.96), (0.93, 0.96),
                        (0.94, 0.95)]},
    })  # fmt: skip
    paths = written(tmp_path, {"both.json": both, "alone.json": alone})
    assert pr.main(["--ours", OURS, "--rival", RIVAL, *paths]) == 0
    out = capsys.readouterr().out
    # The pairs are the two rounds that ran both: 0.95 and 0.88 cannot tell.
    assert "| 9.20 | 2 (1) |" in out
    assert "ours' reuse at 9.20 req/s, mean over rounds" in out and "-> undetermined" in out
    # Every round of ours: eight, seven at or over 0.9, the mean's interval clear of it.
    reuse = [0.95, 0.88, 0.96, 0.97, 0.95, 0.96, 0.96, 0.95]
    mean, low, high = _paired.mean_interval(reuse)
    assert low > 0.9
    line = next(line for line in out.splitlines() if "over every round of ours" in line)
    assert f"(8 rounds, 2 runs): {mean:.3f} ({low:.3f}-{high:.3f}, 95%), 7 of 8" in line
    assert line.endswith("-> met (aim: >= 0.9 at every rate within the SLO)")
    # Where every run paired, nothing is added.
    assert pr.main(["--ours", OURS, "--rival", RIVAL, paths[0]]) == 0
    assert "over every round of ours" not in capsys.readouterr().out


def test_ours_reuse_over_its_rounds_is_not_judged_outside_the_slo() -> None:
    rounds = [_paired.Round("a.json", 13.8, 0.85, 0.95), _paired.Round("b.json", 13.8, 0.86, 0.97)]
    (line,) = pr.reuse_lines(rounds, 0.9)
    assert "not judged: ours met the SLO for 86% of requests" in line


def pair(run: str, index: int, rate: float, ours: float, rival: float) -> _paired.Pair:
    return _paired.Pair(run, index, rate, ours, rival, 0.95)


def rounds_of_pairs(
    curves: list[tuple[float, float, float, float]], run: str = "a.json"
) -> list[_paired.Pair]:
    """Pairs from rounds given as (ours at 9.20, rival at 9.20, ours at 13.80, rival at 13.80)."""
    out = []
    for i, (o1, r1, o2, r2) in enumerate(curves):
        out += [pair(run, i, 9.2, o1, r1), pair(run, i, 13.8, o2, r2)]
    return out


def test_pooled_goodput_is_where_the_rounds_mean_curve_crosses() -> None:
    # Ours' mean curve: 0.92 at 9.20, 0.86 at 13.80 -> crosses 0.9 a third of the way;
    # the rival's: 0.91 and 0.87 -> a quarter of the way.
    pairs = rounds_of_pairs([(0.93, 0.91, 0.85, 0.86), (0.91, 0.91, 0.87, 0.88)])
    pooled = pr.pooled_goodput(pairs, resamples=200)
    assert pooled is not None
    assert pooled.ours.values[0] == pytest.approx(9.2 + 4.6 / 3)
    assert pooled.rival.values[0] == pytest.approx(9.2 + 4.6 / 4)
    assert pooled.rounds == 2
    # Resampling two rounds: every resample's difference lies between the extremes of
    # taking either round twice.
    assert pooled.low <= pooled.ours.values[0] - pooled.rival.values[0] <= pooled.high


def test_pooled_goodput_verdicts_above_below_and_noise() -> None:
    above = rounds_of_pairs(
        [(0.93, 0.91, 0.87, 0.85), (0.92, 0.905, 0.88, 0.86), (0.94, 0.91, 0.86, 0.85)] * 2
    )
    result = pr.pooled_goodput(above)
    assert result is not None and result.verdict == "met" and result.low > 0
    below = rounds_of_pairs(
        [(0.91, 0.93, 0.85, 0.87), (0.905, 0.92, 0.86, 0.88), (0.91, 0.94, 0.85, 0.86)] * 2
    )
    result = pr.pooled_goodput(below)
    assert result is not None and result.verdict == "MISSED" and result.high < 0
    # The sign of the difference flips from round to round: no side can be told.
    noise = rounds_of_pairs(
        [(0.93, 0.91, 0.85, 0.87), (0.91, 0.93, 0.87, 0.85), (0.92, 0.92, 0.86, 0.86)] * 2
    )
    result = pr.pooled_goodput(noise)
    assert result is not None and result.verdict == "undetermined"
    assert result.low < 0 < result.high
    # The same pairs, the same seed: the same interval.
    again = pr.pooled_goodput(noise)
    assert again is not None and (again.low, again.high) == (result.low, result.high)


def test_pooled_goodput_takes_a_curve_that_never_crossed_by_its_worse_bound() -> None:
    # Ours meets the SLO at both rates (goodput at least 13.80), the rival crosses: above.
    pairs = rounds_of_pairs([(0.95, 0.92, 0.91, 0.86), (0.94, 0.91, 0.92, 0.87)])
    result = pr.pooled_goodput(pairs, resamples=200)
    assert result is not None and result.ours.labels[0] == ">= 13.80"
    assert result.low > 0 and result.high == math.inf and result.verdict == "met"
    # Both at least 13.80: at least level, but nothing says by how much either way.
    both = rounds_of_pairs([(0.95, 0.95, 0.91, 0.92), (0.94, 0.96, 0.92, 0.91)])
    result = pr.pooled_goodput(both, resamples=200)
    assert result is not None and result.verdict == "undetermined"
    assert result.low == -math.inf and result.high == math.inf


def test_pooled_goodput_resamples_rounds_with_the_same_rates_together() -> None:
    # Run a measured 4.60 and 9.20, run b 9.20 and 13.80: the crossing lies between 9.20 and
    # 13.80, which only b's rounds measured; every resample keeps two of b's rounds, so every
    # resample's curve reaches 13.80 and crosses.
    a = [pair("a.json", i, 4.6, 0.95, 0.94) for i in range(3)]
    a += [pair("a.json", i, 9.2, 0.93, 0.92) for i in range(3)]
    b = rounds_of_pairs([(0.93, 0.91, 0.87, 0.85), (0.92, 0.91, 0.88, 0.86)], run="b.json")
    result = pr.pooled_goodput(a + b, resamples=300)
    assert result is not None and result.rounds == 5
    assert result.low != -math.inf and result.high != math.inf
    assert result.verdict == "met"
    # One rate only, or one round: nothing to cross or to resample.
    assert pr.pooled_goodput([pair("a.json", i, 9.2, 0.9, 0.9) for i in range(3)]) is None
    assert pr.pooled_goodput(rounds_of_pairs([(0.93, 0.91, 0.87, 0.85)])) is None


def test_pooled_goodput_leaves_out_one_run_at_a_time_from_three_runs() -> None:
    runs = [
        rounds_of_pairs([(0.93, 0.91, 0.87, 0.85), (0.92, 0.91, 0.88, 0.86)], run=f"{n}.json")
        for n in "ab"
    ]
    # The third run's rounds put ours lower: leaving it out lifts ours.
    runs.append(rounds_of_pairs([(0.905, 0.91, 0.85, 0.86)] * 2, run="c.json"))
    result = pr.pooled_goodput([p for run in runs for p in run], resamples=300)
    assert result is not None and len(result.ours_without_one) == 3
    without_c = pr.curve_goodputs(
        list(_paired.by_round([p for run in runs[:2] for p in run]).values())
    )[0]
    # Runs in name order: a, b, c; leaving out c lifts ours above the pooled goodput.
    left_out_c = result.ours_without_one[2].values[0]
    assert left_out_c == pytest.approx(without_c.values[0])
    assert result.ours_without_one[0].values[0] < result.ours.values[0] < left_out_c
    lowest = min(g.values[0] for g in result.ours_without_one)
    assert f"leaving out one run at a time, ours {lowest:.2f}-{left_out_c:.2f}" in result.line()
    two = pr.pooled_goodput([p for run in runs[:2] for p in run], resamples=100)
    assert two is not None and two.ours_without_one == ()
    assert "leaving out" not in two.line()


def test_leaving_out_a_run_that_alone_reached_the_crossing_shows_the_bound() -> None:
    # Run low.json alone measured 4.60 req/s (both above 90%); runs a and b only 9.20 (both
    # below): the pooled curves cross between the two rates. Without low.json they start
    # below 90%, a bound, which the line writes as such (not as a goodput of 0).
    low = [pair("low.json", i, 4.6, 0.95, 0.95) for i in range(2)]
    high = [pair(f"{n}.json", i, 9.2, 0.85, 0.84) for n in "ab" for i in range(2)]
    result = pr.pooled_goodput(low + high, resamples=100)
    assert result is not None and result.ours.crossed
    assert [g.labels[0] for g in result.ours_without_one][2] == "< 9.20"
    line = result.line()
    assert "< 9.20" in line and "0.00-" not in line


def test_pooled_goodput_resamples_whole_runs_for_its_second_verdict() -> None:
    # Four runs of six rounds with ours above, one run with ours below by as much: thirty
    # rounds resampled one by one seldom draw half of them from the one run (met), but five
    # runs resampled whole draw it three times often enough (undetermined).
    good, bad = (0.93, 0.91, 0.87, 0.85), (0.91, 0.93, 0.85, 0.87)
    runs = [rounds_of_pairs([good] * 6, run=f"{n}.json") for n in "abcd"]
    runs.append(rounds_of_pairs([bad] * 6, run="e.json"))
    result = pr.pooled_goodput([p for run in runs for p in run], resamples=2000)
    assert result is not None and result.verdict == "met"
    assert result.run_interval is not None and result.run_verdict == "undetermined"
    low, high = result.run_interval
    assert low < 0 < high and low < result.low
    assert "bootstrap over the 5 runs" in result.line()
    assert "req/s -> undetermined; leaving out one run at a time" in result.line()
    # Every run above: met over runs too.
    above = [rounds_of_pairs([good] * 3, run=f"{n}.json") for n in "abc"]
    result = pr.pooled_goodput([p for run in above for p in run], resamples=500)
    assert result is not None and result.run_verdict == "met"
    # Under three runs there is no interval over runs.
    two = pr.pooled_goodput([p for run in above[:2] for p in run], resamples=100)
    assert two is not None and two.run_interval is None and two.run_verdict is None
    assert "bootstrap over the" not in two.line()
