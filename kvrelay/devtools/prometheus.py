"""Fetching and reading a Prometheus text page (`/metrics`) in the demo, tests and benchmarks.

The parsing is `kvrelay.prometheus_text` (shared with the proxy's engine load signals); this
module adds `scrape`, which fetches a page and parses it.
"""

from __future__ import annotations

import urllib.request

from kvrelay.prometheus_text import parse_samples, series_sum, totals

__all__ = ["parse_samples", "scrape", "series_sum", "totals"]


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """GET `base_url/metrics` and `parse_samples` it."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
        return parse_samples(resp.read().decode())
