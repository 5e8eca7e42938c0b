"""The JSON log format (telemetry.logs): one object per line with the fixed fields, the
caller's fields and the exception; the per-turn summary only in JSON format."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from kvrelay.proxy.config import LogFormat
from kvrelay.proxy.telemetry import logs


def _record(**kwargs: object) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"name": "kvrelay.test", "levelno": logging.WARNING, "levelname": "WARNING",
         "msg": "engine %s said\n%d", "args": ("p0", 503), **kwargs}
    )  # fmt: skip


def test_a_record_is_one_json_line_with_the_fixed_fields() -> None:
    line = logs.JsonFormatter().format(_record(fields={"request_id": "r1", "retries": 2}))
    assert "\n" not in line
    data = json.loads(line)
    assert data["level"] == "WARNING" and data["logger"] == "kvrelay.test"
    assert data["message"] == "engine p0 said\n503"
    assert data["time"].endswith("Z") and "T" in data["time"]
    assert isinstance(data["process"], int)
    assert (data["request_id"], data["retries"]) == ("r1", 2)
    assert "exception" not in data


def test_an_exception_is_one_field_of_the_same_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record(exc_info=sys.exc_info())
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


@pytest.mark.parametrize(("log_format", "summaries"), [("text", False), ("json", True)])
def test_turn_summaries_belong_to_the_json_format(log_format: LogFormat,
                                                  summaries: bool) -> None:  # fmt: skip
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        logs.configure_turn_log(log_format)
        assert logs.turn_log_enabled() is summaries
        assert isinstance(logs.formatter(log_format), logs.JsonFormatter) is summaries
    finally:
        root.setLevel(level)
        logs.TURN_LOG.setLevel(logging.NOTSET)


def test_short_hashes_are_stable_and_hide_the_id() -> None:
    digest = logs.short_hash("tenant", "conversation-secret")
    assert digest == logs.short_hash("tenant", "conversation-secret")
    assert len(digest) == 16 and "conversation" not in digest
    assert digest != logs.short_hash("tenant", "other")
    logs.short_hash("tenant", "bad \udcff byte")  # header bytes that are not UTF-8
