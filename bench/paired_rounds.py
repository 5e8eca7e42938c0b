"""Two configurations' rounds paired over several `trace_compare.py` runs: is one below the other?

One run of `trace_compare.py` has three rounds; between two configurations that are close, the
sign of the difference moves from run to run, and each run alone leaves "never below" to chance.
Within a round the configurations ran interleaved on the same machine minutes apart, so a
round's difference is the fair unit: this script pairs them, round by round, over every `--json`
file that ran both, and says what all of those rounds together show.

Per rate: the SLO attainment's difference (ours minus the rival, points), its mean with a 95%
interval (Student's t over the paired rounds), the same over runs (each run's mean over its rounds,
a run the unit: its rounds share an hour of the host and are not independent), and how many rounds
ours was above, level or below; ours' realized reuse against the LRU bound, mean with its interval
and the rounds at or over the aim (and, where some runs ran ours alone, its reuse over every round
of ours). Per round with the rates to cross the SLO: the goodput of each (as `trace_compare.py`
computes it: a bound where the curve did not cross) and whether ours was above, below, or the
bounds cannot tell. The verdict on "ours never below the rival": MISSED where the interval of the
mean attainment difference lies below zero at a rate, met where it lies at or above zero at every
rate, else level: no difference these rounds can tell, of at most the interval's lower end; given
once with the rounds as the unit and once with the runs (the one to act on where there are several
runs: it does not count a run's shared hour as many independent trials).

Goodput over all the rounds together (`pooled_goodput`): one round's goodput is where its
curve crosses the SLO share, and where both curves run flat near that share (past the knee) a
point of attainment, one request in a hundred, moves that crossing by req/s: round by round the
signs are mostly noise. Each configuration's curve averaged over the paired rounds (each rate's
mean over the rounds that ran it) crosses where the rounds agree; its difference gets a 95%
interval by resampling the rounds (bootstrap, rounds that ran the same rates resampled among
themselves, a fixed seed so the output repeats), and the verdict on "never below" by goodput:
met where the interval lies at or above zero, MISSED where it lies below, else undetermined. A
curve that does not cross counts by its bound (at least the highest rate, below the lowest),
the interval taking the side's worst end. With three runs or more it also resamples whole runs
(each with all its rounds; runs that ran the same rates among themselves), the counterpart of
the attainment's runs-as-the-unit interval, with its own verdict, and gives each side's pooled
goodput leaving out one run at a time: how far one run moves it.

Example: `.venv/bin/python -m bench.paired_rounds --ours 'kvrelay default (2P+6D)' --rival
'kvrelay holds off (2P+6D)' /tmp/runAN.json /tmp/runAR.json` (`--ours` again: another name
the same configuration had in an older run). Prints markdown; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _paired
from bench import trace_compare as tc


def goodput_pairs(
    data: dict[str, Any], ours: Sequence[str], rival: Sequence[str]
) -> list[tuple[tc.Goodput, tc.Goodput]]:
    """Per round of a run with at least two rates: (ours, rival) goodput, one round each."""
    runs = data["runs"]
    mine, theirs = _paired.label_in(runs, ours), _paired.label_in(runs, rival)
    if mine is None or theirs is None or len(runs[mine]) < 2:
        return []
    a = tc.goodputs({float(s): r for s, r in runs[mine].items() if r})
    b = tc.goodputs({float(s): r for s, r in runs[theirs].items() if r})
    return [
        (tc.Goodput((av,), (al,)), tc.Goodput((bv,), (bl,)))
        for av, al, bv, bl in zip(a.values, a.labels, b.values, b.labels, strict=False)
    ]


def goodput_sign(ours: tc.Goodput, rival: tc.Goodput) -> str:
    """above, below, level or unknown (the bounds overlap) for one round's pair. A goodput
    below every rate lies in [0, lowest rate), one above every rate in [highest rate, inf)."""
    (o_lo, o_hi), (r_lo, r_hi) = ours.bounds()[0], rival.bounds()[0]
    o_open, r_open = ours.labels[0].startswith("<"), rival.labels[0].startswith("<")
    if o_lo == o_hi and r_lo == r_hi:  # both crossed within the rates
        return "above" if o_lo > r_lo else "below" if o_lo < r_lo else "level"
    if o_lo > r_hi or (o_lo == r_hi and r_open):
        return "above"
    if o_hi < r_lo or (o_hi == r_lo and o_open):
        return "below"
    return "unknown"


# One paired round: rate -> (ours' attainment, the rival's).
RoundCurves = Mapping[float, tuple[float, float]]
RESAMPLES = 10_000
SEED = 0


def curve_goodputs(rounds: Sequence[RoundCurves]) -> tuple[tc.Goodput, tc.Goodput]:
    """Ours' and the rival's goodput from their attainment curves averaged over `rounds`, each
    rate's mean over the rounds that ran it (one value each, a bound where it did not cross)."""
    by_rate: dict[float, list[tuple[float, float]]] = {}
    for curves in rounds:
        for rate, both in curves.items():
            by_rate.setdefault(rate, []).append(both)
    sides = []
    for side in (0, 1):
        value, label = tc.goodput(
            [(rate, statistics.fmean(b[side] for b in both)) for rate, both in by_rate.items()]
        )
        sides.append(tc.Goodput((value,), (label,)))
    return sides[0], sides[1]


def _difference_bounds(ours: tc.Goodput, rival: tc.Goodput) -> tuple[float, float]:
    """(lowest, highest) that ours minus the rival can be, given each side's bounds."""
    (o_lo, o_hi), (r_lo, r_hi) = ours.bounds()[0], rival.bounds()[0]
    return o_lo - r_hi, o_hi - r_lo


@dataclass(frozen=True)
class PooledGoodput:
    """Goodput of both configurations' curves averaged over the paired rounds, the 95%
    interval of ours minus the rival (bootstrap over rounds), and each side's range leaving
    out one run at a time (empty with fewer than three runs)."""

    ours: tc.Goodput
    rival: tc.Goodput
    low: float
    high: float
    rounds: int
    resamples: int
    # Each side's pooled goodput with one run left out, run by run (empty under three runs).
    ours_without_one: tuple[tc.Goodput, ...] = ()
    rival_without_one: tuple[tc.Goodput, ...] = ()
    # The difference's 95% interval resampling whole runs (None under three runs).
    run_interval: tuple[float, float] | None = None
    runs: int = 0  # the runs the rounds came from

    @property
    def verdict(self) -> str:
        """The verdict with the rounds as the unit."""
        return _verdict(self.low, self.high)

    @property
    def run_verdict(self) -> str | None:
        """The verdict with the runs as the unit (None under three runs): the one to act on
        where there is one, as for the attainment."""
        return None if self.run_interval is None else _verdict(*self.run_interval)

    def line(self) -> str:
        text = (
            f"- goodput of the {self.rounds} paired rounds' mean curves (each rate's mean over "
            f"the rounds that ran it): ours {self.ours.labels[0]} req/s, the rival "
            f"{self.rival.labels[0]}; ours - rival {_signed(self.low)} to {_signed(self.high)} "
            f"req/s (95%, bootstrap over rounds, {self.resamples} resamples)"
        )
        text += f" -> {self.verdict}"
        if self.run_interval is not None:
            low, high = self.run_interval
            text += (
                f"; bootstrap over the {self.runs} runs (a run with all its rounds) "
                f"{_signed(low)} to {_signed(high)} req/s -> {self.run_verdict}"
            )
        if self.ours_without_one and self.rival_without_one:
            text += (
                f"; leaving out one run at a time, ours {_spread(self.ours_without_one)}, the "
                f"rival {_spread(self.rival_without_one)}"
            )
        return f"{text} (aim: ours never below the rival)"


def _verdict(low: float, high: float) -> str:
    if low >= 0:
        return "met"
    if high < 0:
        return "MISSED"
    return "undetermined"


def _signed(value: float) -> str:
    return "-inf" if value == -math.inf else "+inf" if value == math.inf else f"{value:+.2f}"


def pooled_goodput(
    pairs: Sequence[_paired.Pair], resamples: int = RESAMPLES, seed: int = SEED
) -> PooledGoodput | None:
    """Goodput from the rounds' mean curves with its bootstrap interval (see the module's
    text); None where fewer than two rounds paired or no rate but one was measured."""
    rounds = _paired.by_round(pairs)
    if len(rounds) < 2 or len({rate for curves in rounds.values() for rate in curves}) < 2:
        return None
    # Rounds that ran the same rates are resampled among themselves, so every resample has
    # each rate from as many rounds as the data has.
    strata: dict[frozenset[float], list[list[RoundCurves]]] = {}
    for curves in rounds.values():
        strata.setdefault(frozenset(curves), []).append([curves])  # a unit of one round
    low, high = _bootstrap(list(strata.values()), resamples, seed)
    ours, rival = curve_goodputs(list(rounds.values()))
    runs = sorted({run for run, _ in rounds})
    without: list[tuple[tc.Goodput, tc.Goodput]] = []
    run_interval: tuple[float, float] | None = None
    if len(runs) >= 3:
        without = [
            curve_goodputs([c for (run, _), c in rounds.items() if run != left]) for left in runs
        ]
        # A run is resampled with all its rounds (they shared an hour of the host), among the
        # runs that ran the same rates.
        of_run: dict[str, list[RoundCurves]] = {}
        for (run, _), curves in rounds.items():
            of_run.setdefault(run, []).append(curves)
        run_strata: dict[frozenset[float], list[list[RoundCurves]]] = {}
        for run in runs:
            rates = frozenset(rate for curves in of_run[run] for rate in curves)
            run_strata.setdefault(rates, []).append(of_run[run])
        run_interval = _bootstrap(list(run_strata.values()), resamples, seed)
    return PooledGoodput(
        ours,
        rival,
        low,
        high,
        len(rounds),
        resamples,
        tuple(o for o, _ in without),
        tuple(r for _, r in without),
        run_interval,
        len(runs),
    )


def _bootstrap(
    strata: Sequence[Sequence[Sequence[RoundCurves]]], resamples: int, seed: int
) -> tuple[float, float]:
    """The 95% interval of ours' pooled goodput minus the rival's, resampling each stratum's
    units with replacement (as many as it has): a unit is the curves of the rounds drawn
    together (one round, or a run's rounds)."""
    rng = random.Random(seed)
    lows, highs = [], []
    for _ in range(resamples):
        units = [rng.choice(group) for group in strata for _ in group]
        sample = [curves for unit in units for curves in unit]
        low, high = _difference_bounds(*curve_goodputs(sample))
        lows.append(low)
        highs.append(high)
    lows.sort()
    highs.sort()
    tail = int(0.025 * resamples)
    return lows[tail], highs[resamples - 1 - tail]


def _spread(goodputs: Sequence[tc.Goodput]) -> str:
    """lowest-highest where every curve crossed; else each one's value or bound, in order."""
    if all(g.crossed for g in goodputs):
        values = [g.values[0] for g in goodputs]
        return f"{min(values):.2f}-{max(values):.2f}"
    return " / ".join(g.labels[0] for g in goodputs)


def reuse_verdict(low: float, high: float, attainments: Sequence[float], aim: float) -> str:
    """met / MISSED / undetermined by the interval [`low`, `high`] of the rounds' mean reuse;
    not judged where ours met the SLO for fewer than `tc.GOODPUT_ATTAINMENT` of its requests on
    average."""
    slo = statistics.fmean(attainments)
    if slo < tc.GOODPUT_ATTAINMENT:
        return f"not judged: ours met the SLO for {slo:.0%} of requests, outside it"
    return "met" if low >= aim else "MISSED" if high < aim else "undetermined"


def reuse_lines(rounds: Sequence[_paired.Round], aim: float) -> list[str]:
    """Ours' reuse over every round it ran, runs without the rival included: per rate, the mean
    with its interval and the verdict (judged where ours met the SLO on average)."""
    lines = []
    for rate, group in sorted(_paired.by_rate(rounds).items()):
        reuse = [r.reuse for r in group]
        mean, low, high = _paired.mean_interval(reuse)
        verdict = reuse_verdict(low, high, [r.attainment for r in group], aim)
        lines.append(
            f"- ours' reuse at {rate:.2f} req/s over every round of ours ({len(group)} rounds, "
            f"{len({r.run for r in group})} runs): {mean:.3f} ({low:.3f}-{high:.3f}, 95%), "
            f"{sum(r >= aim for r in reuse)} of {len(reuse)} at or over the aim -> {verdict} "
            f"(aim: >= {aim:g} at every rate within the SLO)"
        )
    return lines


def render(
    pairs: list[_paired.Pair],
    goodputs: list[tuple[tc.Goodput, tc.Goodput]],
    aim: float,
    rounds: Sequence[_paired.Round] = (),
) -> str:
    groups = _paired.by_rate(pairs)
    lines = [
        "| req/s | rounds (runs) | SLO met: ours - rival, mean (95% interval) | the same over "
        "runs | above / level / below | ours' reuse vs LRU: mean (95% interval) | rounds >= aim |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    diffs_by_rate = {rate: _paired.differences(group) for rate, group in groups.items()}
    by_run = {rate: _paired.run_differences(group) for rate, group in groups.items()}
    for rate, group in sorted(groups.items()):
        diffs = diffs_by_rate[rate]
        above, level, below = _paired.signs(diffs)
        reuse = [p.ours_reuse for p in group]
        r_mean, r_low, r_high = _paired.mean_interval(reuse)
        lines.append(
            f"| {rate:.2f} | {len(group)} ({len({p.run for p in group})}) | "
            f"{_paired.points_cell(diffs)} | {_paired.points_cell(by_run[rate])} | "
            f"{above} / {level} / {below} | "
            f"{r_mean:.3f} ({r_low:.3f}-{r_high:.3f}) | {sum(r >= aim for r in reuse)} of "
            f"{len(reuse)} |"
        )
    signs = [goodput_sign(a, b) for a, b in goodputs]
    lines += [
        "",
        f"Goodput, round by round ({len(goodputs)} rounds with two rates or more): ours above "
        f"in {signs.count('above')}, level in {signs.count('level')}, below in "
        f"{signs.count('below')}, the bounds cannot tell in {signs.count('unknown')}.",
        "",
        _paired.within_slo_signs(groups, tc.GOODPUT_ATTAINMENT),
        "",
        f"- ours never below the rival (SLO attainment, paired rounds): "
        f"{_paired.attainment_verdict(diffs_by_rate)}",
        f"- ours never below the rival (SLO attainment, runs as the unit): "
        f"{_paired.attainment_verdict(by_run)}",
    ]
    pooled = pooled_goodput(pairs)
    if pooled is not None:
        lines.append(pooled.line())
    for rate, group in sorted(groups.items()):
        _, r_low, r_high = _paired.mean_interval([p.ours_reuse for p in group])
        verdict = reuse_verdict(r_low, r_high, [p.ours_attainment for p in group], aim)
        lines.append(
            f"- ours' reuse at {rate:.2f} req/s, mean over rounds {r_low:.3f}-{r_high:.3f} "
            f"(95%) -> {verdict} (aim: >= {aim:g} at every rate within the SLO)"
        )
    if len(rounds) > len(pairs):
        # Rounds of ours without the rival beside them (runs of ours alone): its reuse is
        # judged on all of them together.
        lines += ["", *reuse_lines(rounds, aim)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("runs", nargs="+", type=Path, help="trace_compare.py --json files")
    for side in ("--ours", "--rival"):
        p.add_argument(
            side, action="append", required=True,
            help="a configuration's label; given again, another name for it (the first found)",
        )  # fmt: skip
    p.add_argument("--reuse-aim", type=float, default=tc.REUSE_AIM)
    args = p.parse_args(argv)
    pairs: list[_paired.Pair] = []
    goodputs: list[tuple[tc.Goodput, tc.Goodput]] = []
    rounds: list[_paired.Round] = []
    for path in args.runs:
        data = json.loads(path.read_text())
        pairs += _paired.pairs_of(path.name, data, args.ours, args.rival)
        rounds += _paired.rounds_of(path.name, data, args.ours)
        goodputs += goodput_pairs(data, args.ours, args.rival)
    if not pairs:
        raise SystemExit("no run measured both configurations")
    print(render(pairs, goodputs, args.reuse_aim, rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
