"""The one Prometheus text parser: each series' labels, escapes undone."""

from __future__ import annotations

from kvrelay.prometheus_text import parse_samples, series_labels

PAGE = """\
# TYPE info gauge
info{a="1",b="two words",c="quote \\" back \\\\ newline \\n end"} 1.0
info{a="2"} 1.0
information{a="3"} 1.0
other 2.0
"""


def test_series_labels_are_read_per_series_with_escapes_undone() -> None:
    labels = series_labels(parse_samples(PAGE), "info")
    assert labels == [
        {"a": "1", "b": "two words", "c": 'quote " back \\ newline \n end'},
        {"a": "2"},
    ]
    assert series_labels(parse_samples(PAGE), "other") == []  # a series without labels
