"""The demo's closing hint points at the metric of realized reuse, not at map lookups."""

from __future__ import annotations

from kvrelay.proxy.demo import usage_text
from kvrelay.proxy.telemetry import metrics


def test_the_closing_hint_greps_the_realized_reuse_counter() -> None:
    # prometheus-client names a counter without its `_total`; the exposition adds it.
    reused = metrics.TOKENS_REUSED.metric.describe()[0].name + "_total"
    hint = usage_text("http://127.0.0.1:8000")
    assert f"/metrics | grep {reused}\n" in hint
