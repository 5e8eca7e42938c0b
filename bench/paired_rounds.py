"""Two configurations' rounds paired over several `trace_compare.py` runs: is one below the other?

One run of `trace_compare.py` has three rounds; between two configurations that are close, the
sign of the difference moves from run to run, and each run alone leaves "never below" to chance.
Within a round the configurations ran interleaved on the same machine minutes apart, so a
round's difference is the fair unit: this script pairs them, round by round, over every `--json`
file that ran both, and says what all of those rounds together show.

Per rate: the SLO attainment's difference (ours minus the rival, points), its mean with a 95%
interval (Student's t over the paired rounds), and how many rounds ours was above, level or
below; ours' realized reuse against the LRU bound, mean with its interval and the rounds at
or over the aim (and, where some runs ran ours alone, its reuse over every round of ours). Per
round with the rates to cross the SLO: the goodput of each (as `trace_compare.py` computes it:
a bound where the curve did not cross) and whether ours was above, below, or the bounds cannot
tell. The verdict on "ours never below the rival": MISSED where the interval of the mean
attainment difference lies below zero at a rate, met where it lies at or above zero at every
rate, else level: no difference these rounds can tell, of at most the interval's lower end.

Example: `.venv/bin/python -m bench.paired_rounds --ours 'kvrelay default (2P+6D)' --rival
'kvrelay holds off (2P+6D)' /tmp/runAN.json /tmp/runAR.json` (`--ours` again: another name
the same configuration had in an older run). Prints markdown; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
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
        "| req/s | rounds (runs) | SLO met: ours - rival, mean (95% interval) | above / level / "
        "below | ours' reuse vs LRU: mean (95% interval) | rounds >= aim |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    diffs_by_rate = {rate: _paired.differences(group) for rate, group in groups.items()}
    for rate, group in sorted(groups.items()):
        diffs = diffs_by_rate[rate]
        above, level, below = _paired.signs(diffs)
        reuse = [p.ours_reuse for p in group]
        r_mean, r_low, r_high = _paired.mean_interval(reuse)
        lines.append(
            f"| {rate:.2f} | {len(group)} ({len({p.run for p in group})}) | "
            f"{_paired.points_cell(diffs)} | {above} / {level} / {below} | "
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
    ]
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
