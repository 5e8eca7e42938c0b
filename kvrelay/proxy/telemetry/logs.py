"""Log formats of the proxy: text (the default) or JSON, one object per line.

A JSON line always has `time` (UTC, ISO 8601), `level`, `logger`, `message` and `process`;
`exception` when the record carries one; and the fields a caller passes with
`extra={"fields": {...}}`. In JSON format every turn also writes one summary line on the
`kvrelay.turn` logger at INFO (`turn_summary`): request id, tenant (a hash of the API key, never
the key), a hash of the conversation's map key, the reuse result, both legs (engine URL, HTTP
status, attempts) and durations. No line carries a prompt, an answer, a key, a secret or a
release token: the summary is built from ids and numbers only, and tests/security checks every
line the fleet writes, at DEBUG.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
from typing import Any

from kvrelay.proxy.config import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"

TURN_LOG = logging.getLogger("kvrelay.turn")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, separators=(",", ":"), default=str)


def formatter(log_format: LogFormat) -> logging.Formatter:
    """The formatter of `log_format`."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure_turn_log(log_format: LogFormat) -> None:
    """Turn summaries are part of the JSON format; text logs stay as they were (one line per
    problem, none per request)."""
    TURN_LOG.setLevel(logging.NOTSET if log_format == "json" else logging.WARNING)


def turn_log_enabled() -> bool:
    """Whether a finished turn should build and write its summary line."""
    return TURN_LOG.isEnabledFor(logging.INFO)


def short_hash(*parts: str) -> str:
    """A short, stable hash of ids that should not appear in logs as they are."""
    # surrogatepass: ids may hold any header bytes (see kvrelay.proxy.http.headers).
    digest = hashlib.sha256("\n".join(("kvrelay-log", *parts)).encode(errors="surrogatepass"))
    return digest.hexdigest()[:16]


def log_turn(message: str, fields: dict[str, Any]) -> None:
    """Write one turn summary (`fields`: ids, hashes and numbers only)."""
    TURN_LOG.info(message, extra={"fields": fields})
