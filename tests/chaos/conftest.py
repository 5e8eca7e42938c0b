"""Chaos suite hooks: the run's counts go to pytest's terminal summary (visible without -s)."""

from __future__ import annotations

from typing import Any

from kvrelay.devtools import chaos_load


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, text in chaos_load.SUMMARIES:
        terminalreporter.write_sep("=", title)
        terminalreporter.write_line(text)
