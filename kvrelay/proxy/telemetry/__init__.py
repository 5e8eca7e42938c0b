"""What operators see: Prometheus metrics (`metrics`), OpenTelemetry spans (`tracing`), log lines
(`logs`). Each is exported as a module: callers write `metrics.REQUESTS`, `tracing.span(...)`.
"""

from kvrelay.proxy.telemetry import logs, metrics, tracing

__all__ = ["logs", "metrics", "tracing"]
