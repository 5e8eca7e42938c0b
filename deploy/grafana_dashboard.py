#!/usr/bin/env python3
"""Source of the Grafana dashboard shipped in the chart (`helm/kvrelay/dashboards/kvrelay.json`).

Panels are declared here and written out as Grafana JSON, so a query change is a one-line edit:

    python deploy/grafana_dashboard.py --write   # regenerate the chart's dashboard
    python deploy/grafana_dashboard.py --check   # exit 1 when the committed JSON is stale

Every query filters on the `$job` variable and uses the `$datasource` variable; tests check the
metric and label names against `kvrelay/proxy/telemetry/metrics.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent.parent / "helm" / "kvrelay" / "dashboards" / "kvrelay.json"
SEL = 'job=~"$job"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


class Layout:
    """Collects panels and places them on Grafana's 24-column grid, row by row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0

    def row(self, title: str) -> None:
        """Start a row below the previous one; panels then fill it left to right."""
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "id": len(self.panels) + 1,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def panel(
        self,
        title: str,
        description: str,
        targets: list[tuple[str, str]],
        *,
        w: int,
        unit: str = "short",
        kind: str = "timeseries",
        stack: bool = False,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        defaults: dict[str, Any] = {"unit": unit}
        if bounds is not None:
            defaults["min"], defaults["max"] = bounds
        if stack:
            defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 20}
        options: dict[str, Any]
        if kind == "stat":
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
            }
        else:
            options = {
                "legend": {
                    "displayMode": "table",
                    "placement": "bottom",
                    "calcs": ["lastNotNull", "max"],
                },
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        self.panels.append(
            {
                "type": kind,
                "title": title,
                "description": description,
                "id": len(self.panels) + 1,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "targets": [
                    {
                        "refId": chr(65 + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": DATASOURCE,
                    }
                    for i, (expr, legend) in enumerate(targets)
                ],
                "options": options,
            }
        )
        self.x += w

    def breakdown(
        self, title: str, description: str, metric: str, labels: str, *, w: int, unit: str
    ) -> None:
        """A stacked panel of `metric`'s rate split by `labels`."""
        self.panel(title, description, [by_labels(labels, metric)], w=w, unit=unit, stack=True)

    def ratio_stat(
        self, title: str, description: str, legend: str, metric: str, matchers: str, *, w: int
    ) -> None:
        """A 0..1 stat: the share of `metric`'s rate whose labels match `matchers` (5m)."""
        share = ratio(f"sum({rate(metric, matchers)})", f"sum({rate(metric)})")
        self.panel(
            title,
            description,
            [(share, legend)],
            w=w,
            unit="percentunit",
            kind="stat",
            bounds=(0, 1),
        )


def by_labels(labels: str, metric: str, matchers: str = "") -> tuple[str, str]:
    """The rate of `metric` summed per `labels` ("a, b"), with the legend naming them."""
    legend = " ".join("{{" + label.strip() + "}}" for label in labels.split(","))
    return f"sum by ({labels}) ({rate(metric, matchers)})", legend


def sel(metric: str, matchers: str = "") -> str:
    """`metric{job=~"$job",<matchers>}`: every query follows the dashboard's job filter."""
    return metric + "{" + ",".join(m for m in (SEL, matchers) if m) + "}"


def rate(metric: str, matchers: str = "") -> str:
    return f"rate({sel(metric, matchers)}[5m])"


def ratio(numerator: str, denominator: str) -> str:
    # clamp_min keeps an idle proxy at 0 instead of NaN.
    return f"{numerator} / clamp_min({denominator}, 1e-9)"


def build() -> dict[str, Any]:
    """The whole dashboard as a JSON-ready dict."""
    g = Layout()
    g.row("Reuse")
    # Realized reuse, as the engines reported it: a map lookup hit is only an offer.
    reused = f"sum({rate('kvrelay_tokens_reused_total')})"
    g.panel(
        "Realized reuse",
        "Share of prompt tokens that the engine prefilling the turn did not compute (its local "
        "prefix hit + what it loaded from D's hold), as the engines reported it (5m). Turns "
        "whose engine gave no figure are left out (see kvrelay_leg_accounts_total).",
        [(ratio(reused, f"sum({rate('kvrelay_turn_prompt_tokens_total')})"), "reused")],
        w=4,
        unit="percentunit",
        kind="stat",
        bounds=(0, 1),
    )
    g.breakdown(
        "Prompt tokens by leg and source / s",
        "Each leg's prompt tokens as its engine reported them: local_hit, loaded (P: from D's "
        "hold; D on a turn through P: from P), cached (a stock engine's total), computed, "
        "unknown (no figure).",
        "kvrelay_prompt_tokens_total",
        "leg, source",
        w=8,
        unit="short",
    )
    g.breakdown(
        "Refused blocks / s",
        "Offered blocks an engine did not load, by reason: hash (the history re-rendered or "
        "diverged), local (already cached), partial, unverified, threshold, failed.",
        "kvrelay_refused_blocks_total",
        "leg, reason",
        w=4,
        unit="short",
    )
    g.breakdown(
        "Map lookups by result",
        "What the conversation map offered (a lookup, not a reuse): hit, miss, refused "
        "(history check), expired, unverifiable, holder_unavailable, map_unavailable.",
        "kvrelay_reuse_total",
        "result",
        w=4,
        unit="reqps",
    )
    requests = "kvrelay_requests_total"
    not_ok = 'outcome!="ok"'
    g.ratio_stat(
        "Error ratio",
        "Share of client requests that did not end ok (5m).",
        "errors",
        requests,
        not_ok,
        w=4,
    )
    g.row("Latency")
    ttft = f"sum by (le) ({rate('kvrelay_ttft_seconds_bucket')})"
    g.panel(
        "TTFT",
        "Client request to the first byte of D's answer.",
        [(f"histogram_quantile({q}, {ttft})", f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)],
        w=8,
        unit="s",
    )
    legs = f"sum by (le, leg) ({rate('kvrelay_leg_latency_seconds_bucket')})"
    g.panel(
        "Leg latency (p50, p95)",
        "Per engine leg (prefill: whole response; decode: to the last byte).",
        [
            (f"histogram_quantile(0.95, {legs})", "{{leg}} p95"),
            (f"histogram_quantile(0.5, {legs})", "{{leg}} p50"),
        ],
        w=8,
        unit="s",
    )
    by = "sum by (leg, outcome)"
    g.panel(
        "Leg mean latency by outcome",
        "Mean time of a leg, per leg and outcome.",
        [
            (
                ratio(
                    f"{by} ({rate('kvrelay_leg_latency_seconds_sum')})",
                    f"{by} ({rate('kvrelay_leg_latency_seconds_count')})",
                ),
                "{{leg}} {{outcome}}",
            )
        ],
        w=8,
        unit="s",
    )
    g.row("Traffic and errors")
    g.breakdown(
        "Requests by outcome",
        "Client requests per route and outcome.",
        requests,
        "route, outcome",
        w=8,
        unit="reqps",
    )
    g.panel(
        "Errors by kind",
        "Failed client requests by outcome (client_error, upstream_error, client_disconnected, "
        "error), retries on another engine, fallbacks (decode_only), conversation-map failures.",
        [
            by_labels("outcome", requests, not_ok),
            (f"sum by (leg) ({rate('kvrelay_retries_total')})", "retry {{leg}}"),
            (f"sum by (kind) ({rate('kvrelay_fallbacks_total')})", "fallback {{kind}}"),
            (f"sum by (op) ({rate('kvrelay_map_unavailable_total')})", "map unavailable {{op}}"),
        ],
        w=8,
        unit="ops",
    )
    g.panel(
        "In-flight requests",
        "Client requests being served, per route.",
        [(f"sum by (route) ({sel('kvrelay_inflight_requests')})", "{{route}}")],
        w=8,
    )
    g.row("Backends and held KV")
    g.panel(
        "Backend health",
        "1 = engine in its pool, 0 = ejected by health checks.",
        [(f"max by (role, backend) ({sel('kvrelay_backend_healthy')})", "{{role}} {{backend}}")],
        w=8,
        bounds=(0, 1),
    )
    g.breakdown(
        "Held-block releases",
        "Releases the proxy sent to holders, by holder role and result.",
        "kvrelay_releases_total",
        "holder, result",
        w=8,
        unit="ops",
    )
    g.breakdown(
        "Where D's params came from",
        "response, stream, side_channel, or missing (no reuse on the next turn).",
        "kvrelay_finished_params_total",
        "source",
        w=8,
        unit="ops",
    )
    job_query = "label_values(kvrelay_requests_total, job)"
    return {
        "title": "kvrelay",
        "uid": "kvrelay-overview",
        "description": "kvrelay proxy: KV reuse, latency per leg, errors, backend health, "
        "held-block releases, in-flight requests.",
        "tags": ["kvrelay", "vllm", "llm"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "graphTooltip": 1,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "job",
                    "label": "Job",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {"query": job_query, "refId": "job"},
                    "definition": job_query,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "refresh": 2,
                    "current": {},
                    "hide": 0,
                    "sort": 1,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the kvrelay Grafana dashboard.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {OUTPUT.name} in the chart")
    mode.add_argument("--check", action="store_true", help="exit 1 when the chart's is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        OUTPUT.write_text(text)
    elif args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python deploy/grafana_dashboard.py --write")
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
