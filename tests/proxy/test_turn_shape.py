"""The turn's shape, kept by reading its code: the report is written and never read for a
decision, and only the crew reaches into the fleet.

A turn that decides on what its report holds hides its state in its logbook; a step that takes
the whole fleet cannot be read without it. Both rules are checked on the syntax tree of
`kvrelay/proxy/turn/`, and each check is shown to find what it is for in a made-up module.
"""

from __future__ import annotations

import ast
from pathlib import Path

TURN = Path(__file__).resolve().parents[2] / "kvrelay" / "proxy" / "turn"
REPORT_NAMES = {"report", "_report"}
# The one module where the turn's room meets the fleet (`TurnCrew.of`).
CREW = "crew.py"
MOST_FLEET_REACHES = 9


def _is_report(node: ast.expr) -> bool:
    """`report`, `self.report`, `self._report`, `attempts.report`..."""
    if isinstance(node, ast.Name):
        return node.id in REPORT_NAMES
    return isinstance(node, ast.Attribute) and node.attr in REPORT_NAMES


def report_reads(source: str) -> list[str]:
    """Each place the code reads something off a turn's report: an attribute of it that is
    neither called (a method: the report is told something) nor assigned to."""
    tree = ast.parse(source)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_report(node.value):
            continue
        if isinstance(node.ctx, ast.Store) or id(node) in called:
            continue
        reads.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads


def fleet_reaches(source: str) -> list[str]:
    """Each `fleet.<name>` in the code."""
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "fleet"
    ]


def test_the_report_is_never_read_in_the_turn() -> None:
    found = {
        path.name: reads
        for path in sorted(TURN.glob("*.py"))
        if path.name != "report.py" and (reads := report_reads(path.read_text()))
    }
    assert not found, f"the turn reads its report (keep the state on the turn): {found}"


def test_only_the_crew_reaches_into_the_fleet() -> None:
    reaches = {path.name: fleet_reaches(path.read_text()) for path in sorted(TURN.glob("*.py"))}
    elsewhere = {name: found for name, found in reaches.items() if found and name != CREW}
    assert not elsewhere, f"turn steps take the fleet's parts from the crew: {elsewhere}"
    assert 0 < len(reaches[CREW]) <= MOST_FLEET_REACHES, reaches[CREW]
    for path in TURN.glob("*.py"):
        if path.name != CREW:
            assert "Fleet" not in path.read_text(), f"{path.name} names the Fleet"


def test_the_checks_find_what_they_are_for() -> None:
    made_up = """
def step(self, report, fleet):
    report.routed("spilled")              # told: fine
    report.hold = True                    # written: fine
    self._report.leg_answered("decode", 200)
    if report.hold:                       # read for a decision
        pass
    record = self.report.decode_leg       # read
    hook = report.on_attempt("prefill")   # a call: fine
    return fleet.router, fleet.kvmap.take
"""
    assert report_reads(made_up) == ["line 6: report.hold", "line 8: self.report.decode_leg"]
    assert fleet_reaches(made_up) == ["line 10: fleet.router", "line 10: fleet.kvmap"]
