"""Reading a Prometheus text page (`/metrics`): the one parser kvrelay has.

The proxy reads engines' load gauges with it (`kvrelay.proxy.fleet`); the demo, tests and
benchmarks read pages through `kvrelay.devtools.prometheus`, which adds fetching. Three views:
`parse_samples` keeps every series apart under its full `name{labels}` key; `totals` folds the
series of each metric together (a counter summed over its labels); `bucket_counts` reads one
histogram's buckets by bound; `series_labels` reads each series' labels (an info metric's
values are its labels). Comment lines and unparsable values are skipped; an optional
timestamp after the value is ignored.
"""

from __future__ import annotations

import contextlib
import re

# One `name="value"` pair of a series' labels; a value escapes `\`, `"` and newlines.
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r"\\.")
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _split_sample(line: str) -> tuple[str, str] | None:
    # Label values may contain spaces, so the series ends at the closing brace when there is one.
    close = line.rfind("}")
    if close >= 0:
        series, rest = line[: close + 1], line[close + 1 :].split()
    else:
        series, *rest = line.split()
    return (series, rest[0]) if rest else None


def parse_samples(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` for every sample on the page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample = _split_sample(line)
        if sample is None:
            continue
        with contextlib.suppress(ValueError):
            out[sample[0]] = float(sample[1])
    return out


def totals(samples: dict[str, float]) -> dict[str, float]:
    """Sum the series of each metric: `{"name": sum over its label sets}`."""
    out: dict[str, float] = {}
    for series, value in samples.items():
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


def series_sum(samples: dict[str, float], name: str) -> float:
    """Sum of every series of metric `name` (0 when it has none)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def bucket_counts(samples: dict[str, float], name: str) -> dict[float, float]:
    """Histogram `name`'s cumulative count per bucket bound (`le`, +Inf as `math.inf`), summed
    over its other labels (an engine's cores); empty when the page has no such histogram."""
    out: dict[float, float] = {}
    prefix = name + "_bucket{"
    for series, value in samples.items():
        if not series.startswith(prefix):
            continue
        start = series.find('le="')
        if start < 0:
            continue
        start += 4
        with contextlib.suppress(ValueError):  # float() reads "+Inf" as inf
            bound = float(series[start : series.find('"', start)])
            out[bound] = out.get(bound, 0.0) + value
    return out


def series_labels(samples: dict[str, float], name: str) -> list[dict[str, str]]:
    """The labels of every series of metric `name`, one dict per series (values unescaped)."""
    prefix = name + "{"
    return [
        {key: _unescape(value) for key, value in _LABEL.findall(series[len(prefix) : -1])}
        for series in samples
        if series.startswith(prefix)
    ]


def _unescape(value: str) -> str:
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m.group(0), m.group(0)), value)
