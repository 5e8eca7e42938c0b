"""The proxy-bound bench's judgement against a baseline tree: a ratio is within noise when the
baseline's own rounds in the same case moved at least as much."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench import _common as c
from bench import _proxybound, proxy_overhead


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


def cases_of(target: str, rounds_by_conc: dict[int, list[float]]) -> list[dict[str, Any]]:
    out = []
    for conc, rounds_rps in rounds_by_conc.items():
        one = case(target, rounds_rps)
        one["concurrency"] = conc
        out.append(one)
    return out


BASE_ROUNDS: dict[int, list[float]] = {1: [100, 110, 105, 95, 102], 64: [200, 220, 190, 210, 205]}


def test_a_cost_every_case_passes_alone_is_found_by_the_pooled_paired_rounds() -> None:
    # 5% slower than the base in every round: within each case's spread (1.16 and 1.16), but
    # 10 rounds of 10 agree.
    slower = {conc: [r * 0.95 for r in rounds] for conc, rounds in BASE_ROUNDS.items()}
    cases = cases_of(_proxybound.BASE, BASE_ROUNDS) + cases_of("kvrelay-w1", slower)
    mean, low, high, paired = _proxybound.paired_ratio(cases, "kvrelay-w1") or (0, 0, 0, 0)
    assert paired == 10
    assert math.isclose(mean, 0.95) and math.isclose(low, 0.95) and math.isclose(high, 0.95)
    text = "\n".join(_proxybound.baseline_lines({"cases": cases}))
    assert "kvrelay-w1 req/s within noise of kvrelay-w1-base in 2 of 2 cases: met" in text
    assert "pooled over 10 paired rounds of every case: 0.950x" in text
    assert "slower beyond noise: MISSED" in text


def test_rounds_that_move_both_ways_are_level_and_met() -> None:
    moved = {
        conc: [r * (0.9 if i % 2 else 1.1) for i, r in enumerate(rounds)]
        for conc, rounds in BASE_ROUNDS.items()
    }
    cases = cases_of(_proxybound.BASE, BASE_ROUNDS) + cases_of("kvrelay-w1", moved)
    _, low, high, _ = _proxybound.paired_ratio(cases, "kvrelay-w1") or (0, 0, 0, 0)
    assert low < 1 < high
    assert ", level: met" in (_proxybound.paired_line(cases, "kvrelay-w1") or "")


def test_faster_beyond_noise_is_met_and_one_paired_round_is_not_judged() -> None:
    faster = {conc: [r * 1.2 for r in rounds] for conc, rounds in BASE_ROUNDS.items()}
    cases = cases_of(_proxybound.BASE, BASE_ROUNDS) + cases_of("kvrelay-w1", faster)
    assert "faster beyond noise: met" in (_proxybound.paired_line(cases, "kvrelay-w1") or "")
    one = cases_of(_proxybound.BASE, {1: [100]}) + cases_of("kvrelay-w1", {1: [90]})
    assert _proxybound.paired_ratio(one, "kvrelay-w1") is None
    assert _proxybound.paired_line(one, "kvrelay-w1") is None


def test_cases_of_one_round_each_give_no_interval_however_many_they_are() -> None:
    # One round per case (`--quick`): resampled within itself a case has no spread, so pooling
    # such cases would print a point as an interval and call 10% slower beyond noise.
    base = {1: [100.0], 64: [200.0], 256: [300.0]}
    slower = {conc: [r * 0.9 for r in rounds] for conc, rounds in base.items()}
    cases = cases_of(_proxybound.BASE, base) + cases_of("kvrelay-w1", slower)
    assert _proxybound.paired_ratio(cases, "kvrelay-w1") is None
    # A case of two rounds beside them is judged on its own rounds only.
    cases += cases_of(_proxybound.BASE, {8: [100.0, 110.0]})
    cases += cases_of("kvrelay-w1", {8: [95.0, 99.0]})
    _, _, _, paired = _proxybound.paired_ratio(cases, "kvrelay-w1") or (0, 0, 0, 0)
    assert paired == 2


def test_a_results_path_given_is_used_as_given_and_the_default_names_the_modes_file(
    tmp_path: Path,
) -> None:
    given = tmp_path / "run.json"
    args = proxy_overhead.parse_args(["--proxy-bound", "--json", str(given)])
    assert _proxybound.results_path(args) == given
    args = proxy_overhead.parse_args(["--proxy-bound"])
    assert _proxybound.results_path(args) == c.WORK_DIR / "proxy_bound.json"
    args = proxy_overhead.parse_args(["--proxy-bound", "--tracing", "both"])
    assert _proxybound.results_path(args) == c.WORK_DIR / "proxy_bound_tracing.json"


def test_the_compiled_target_runs_beside_kvrelay_w1_and_is_judged_against_the_base() -> None:
    args = proxy_overhead.parse_args(
        ["--proxy-bound", "--compiled", "--baseline-src", "/tmp/base", "--targets", "kvrelay-w1"]
    )
    assert _proxybound.Bench(args).targets() == [
        _proxybound.BASE,
        "kvrelay-w1",
        _proxybound.COMPILED,
    ]
    plain = proxy_overhead.parse_args(["--proxy-bound", "--targets", "kvrelay-w1"])
    assert _proxybound.COMPILED not in _proxybound.Bench(plain).targets()
    data = {
        "baseline": "/tmp/base",
        "cases": [
            case(_proxybound.BASE, [100, 110, 105], cpu=100),
            case("kvrelay-w1", [90, 99, 95], cpu=110),
            case(_proxybound.COMPILED, [101, 112, 104], cpu=98),
        ],
    }
    text = "\n".join(_proxybound.baseline_lines(data))
    assert f"{_proxybound.COMPILED} req/s within noise of kvrelay-w1-base in 1 of 1 cases" in text
    assert f"- {_proxybound.COMPILED} req/s over kvrelay-w1-base's in the same round" in text


def test_src_runs_our_targets_from_another_tree_checked_to_import_it(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "kvrelay").mkdir(parents=True)
    (tree / "kvrelay" / "__init__.py").write_text("")
    args = proxy_overhead.parse_args(
        ["--proxy-bound", "--src", str(tree), "--baseline-src", "/tmp/base", "--tracing", "on"]
    )
    bench = _proxybound.Bench(args)
    env = bench._env_of_tree(tree, "--src", traced=True)
    assert env["PYTHONPATH"] == str(tree)
    assert env["KVRELAY_TRACING"] == "on"  # traced as every kvrelay target of the run
    # A tree without its own kvrelay/ would run this checkout's proxy under another name.
    with pytest.raises(SystemExit, match="--src"):
        bench._env_of_tree(tmp_path, "--src")
    data = {"cases": [], "placement": "x", "src": str(tree)}
    assert f"kvrelay-w1 and kvrelay-w2 ran the proxy from {tree}" in _proxybound.render(data, args)


@pytest.mark.parametrize(
    "extra",
    [[], ["--proxy-bound", "--compiled"], ["--proxy-bound", "--without", "metrics"],
     ["--proxy-bound", "--tracing", "both"]],
)  # fmt: skip
def test_src_is_refused_where_a_target_would_be_this_checkouts_variant(extra: list[str]) -> None:
    # Outside the proxy-bound mode, or beside targets that vary this checkout's proxy.
    with pytest.raises(SystemExit):
        proxy_overhead.parse_args([*extra, "--src", "/tmp/tree"])


class _FakeProcess:
    """A stand-in router process: records that it was stopped."""

    def __init__(self, stopped: list[str], name: str) -> None:
        self.stopped, self.name = stopped, name

    def stop(self) -> None:
        self.stopped.append(self.name)


def test_routers_start_afresh_each_round_in_a_rotated_order_keeping_their_work() -> None:
    args = proxy_overhead.parse_args(
        ["--proxy-bound", "--targets", "kvrelay-w1", "--baseline-src", "/tmp/base"]
    )
    bench = _proxybound.Bench(args)
    started: list[str] = []
    stopped: list[str] = []
    work = {"kvrelay-w1": 3.0, _proxybound.BASE: 5.0}

    def starter(name: str) -> Any:
        def start() -> c.RunningRouter:
            started.append(name)
            process: Any = _FakeProcess(stopped, name)
            return c.RunningRouter(name=name, url="http://x", process=process)

        return start

    def work_now() -> dict[str, dict[str, float]]:
        return {name: {"reuse_total": work[name]} for name in bench.routers}

    bench._starters = {t: starter(t) for t in (_proxybound.BASE, "kvrelay-w1")}
    bench._work_now = work_now  # type: ignore[method-assign]
    bench.start_routers(bench.router_targets())
    assert started == [_proxybound.BASE, "kvrelay-w1"]
    bench.restart_routers(shift=1)
    assert stopped == [_proxybound.BASE, "kvrelay-w1"]
    assert started[2:] == ["kvrelay-w1", _proxybound.BASE]  # the other one starts first
    bench.restart_routers(shift=2)
    assert started[4:] == [_proxybound.BASE, "kvrelay-w1"]
    # Every process's counters add up: two stopped and the one running now.
    assert bench.work_done() == {
        "kvrelay-w1": {"reuse_total": 9.0},
        _proxybound.BASE: {"reuse_total": 15.0},
    }


def _run_of(ratio: float, wobble: float) -> list[dict[str, Any]]:
    """One run's cases: the base at 100-110 req/s in three cases of three rounds, kvrelay-w1
    at `ratio` of it in every round, each round moved by +-`wobble` in turn."""
    base = {1: [100.0, 105.0, 110.0], 64: [104.0, 100.0, 108.0], 256: [110.0, 102.0, 100.0]}
    moves = [1 + wobble, 1 - wobble, 1.0]
    ours = {k: [r * ratio * m for r, m in zip(v, moves, strict=True)] for k, v in base.items()}
    return cases_of(_proxybound.BASE, base) + cases_of("kvrelay-w1", ours)


def test_runs_that_each_look_certain_but_disagree_are_judged_level_over_runs(
    tmp_path: Path,
) -> None:
    # Each run alone pools to an interval that excludes the other run's figure.
    slow, even = _run_of(0.95, 0.01), _run_of(1.0, 0.01)
    for run in (slow, even):
        _, low, high, _ = _proxybound.paired_ratio(run, "kvrelay-w1") or (0, 0, 0, 0)
        assert high - low < 0.05
    judged = _proxybound.runs_ratio([slow, even, slow, even])
    assert judged is not None
    mean, low, high, ratios = judged
    assert [round(r, 3) for r in ratios] == [0.95, 1.0, 0.95, 1.0]
    assert low < 1 < high  # over the runs: not told from level
    assert mean == pytest.approx(math.sqrt(0.95), rel=1e-3)
    paths = []
    for i, run in enumerate((slow, even, slow, even)):
        paths.append(tmp_path / f"run{i}.json")
        c.write_json(paths[-1], {"cases": run})
    text = "\n".join(_proxybound.runs_lines(paths))
    assert "over the 4 runs: 0.975x" in text and "level: met" in text


def test_runs_that_agree_on_a_cost_are_judged_slower_and_one_run_is_not_judged(
    tmp_path: Path,
) -> None:
    judged = _proxybound.runs_ratio([_run_of(0.95, 0.01), _run_of(0.96, 0.02), _run_of(0.94, 0)])
    assert judged is not None and judged[2] < 1  # the whole interval below 1
    assert _proxybound.runs_ratio([_run_of(0.95, 0.01)]) is None
    path = tmp_path / "one.json"
    c.write_json(path, {"cases": _run_of(0.95, 0.01)})
    assert "fewer than two of the 1 runs" in "\n".join(_proxybound.runs_lines([path]))
    args = proxy_overhead.parse_args(["--proxy-bound", "--judge-runs", str(path), str(path)])
    assert args.judge_runs == [path, path]
