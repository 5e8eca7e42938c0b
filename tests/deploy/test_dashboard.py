"""The Grafana dashboard queries only metrics (and labels) that the proxy really exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from kvrelay.proxy.telemetry import metrics
from tests.deploy.conftest import CHART
from tests.harness import REPO_ROOT

DASHBOARD = CHART / "dashboards" / "kvrelay.json"
METRIC = re.compile(r"\b(kvrelay_[a-zA-Z0-9_]+)\b(?:\{([^}]*)\})?")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Labels Prometheus adds at scrape time, and the histogram bucket label.
SCRAPE_LABELS = {"job", "instance", "namespace", "pod", "le"}
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def _exported() -> dict[str, set[str]]:
    """Every sample name proxy.metrics exposes -> the label names it carries."""
    out: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, metrics.Labelled):
            value = value.metric  # children bound once; the metric itself is inside
        if isinstance(value, MetricWrapperBase):
            kind = value._type
            labels = set(value._labelnames)
            for suffix in SUFFIXES[kind]:
                out[value._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def _targets(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield from panel.get("targets", [])
        yield from _targets(panel.get("panels", []))


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def test_every_queried_metric_and_label_exists() -> None:
    exported = _exported()
    assert exported, "kvrelay.proxy.telemetry.metrics defines no metrics"
    exprs = [t["expr"] for t in _targets(_dashboard()["panels"])]
    assert exprs
    for expr in exprs:
        used = METRIC.findall(expr)
        assert used, f"query without a kvrelay_ metric: {expr}"
        labels_here: set[str] = set()
        for name, selector in used:
            assert name in exported, f"{name} is not exported by telemetry/metrics.py ({expr})"
            labels_here |= exported[name]
            for matcher in filter(None, (m.strip() for m in selector.split(","))):
                label = re.split(r"[=!~]", matcher, maxsplit=1)[0].strip()
                assert label in exported[name] | SCRAPE_LABELS, f"{name} has no label {label}"
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in labels_here | SCRAPE_LABELS, f"no label {label} in {expr}"


def test_dashboard_covers_the_operator_questions() -> None:
    queried = " ".join(t["expr"] for t in _targets(_dashboard()["panels"]))
    for needed in (
        "kvrelay_reuse_total",  # map lookups
        "kvrelay_tokens_reused_total",  # realized reuse
        "kvrelay_prompt_tokens_total",  # where prompt tokens came from
        "kvrelay_refused_blocks_total",  # offered, not loaded
        "kvrelay_leg_latency_seconds_bucket",  # per-leg latency
        "kvrelay_requests_total",  # errors by kind
        "kvrelay_backend_healthy",  # backend health
        "kvrelay_releases_total",  # held-block releases
        "kvrelay_inflight_requests",  # in-flight
    ):
        assert needed in queried, needed


def test_dashboard_is_well_formed_for_grafana() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job"} <= variables
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert all('job=~"$job"' in t["expr"] for t in panel["targets"]), panel["title"]


def test_committed_dashboard_is_the_generated_one() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "deploy" / "grafana_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
