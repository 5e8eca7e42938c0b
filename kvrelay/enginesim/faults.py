"""Fault injection flags, set with `POST /admin/faults` (CONTRACTS §5) by tests and chaos runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvrelay.enginesim.openai_api import ApiError


@dataclass
class Faults:
    """Current faults. `fail_next_n` counts down as requests are failed; `fail_marker`, when
    set, fails (with `fail_status`) every request whose body contains it, the way an engine
    fails on input it cannot handle. `extra_waiting` adds to the queue `/metrics` reports
    (`vllm:num_requests_waiting`), as if other clients' requests were waiting: a busy engine."""

    fail_next_n: int = 0
    fail_status: int = 500
    fail_marker: str = ""
    delay_ms: int = 0
    refuse_admission: bool = False
    drop_nixl_agent: bool = False
    extra_waiting: int = 0

    def update(self, body: Any) -> None:
        """Apply a partial update; unknown keys or wrong types are a 400."""
        if not isinstance(body, dict):
            raise ApiError(400, "faults body must be a JSON object")
        known = asdict(self)
        for key, value in body.items():
            if key not in known:
                raise ApiError(400, f"unknown fault {key!r}", param=key)
            if isinstance(known[key], bool):
                if not isinstance(value, bool):
                    raise ApiError(400, f"{key} must be a boolean", param=key)
            elif isinstance(known[key], str):
                if not isinstance(value, str):
                    raise ApiError(400, f"{key} must be a string", param=key)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ApiError(400, f"{key} must be a non-negative integer", param=key)
        if "fail_status" in body and not 400 <= body["fail_status"] <= 599:
            raise ApiError(400, "fail_status must be a 4xx or 5xx code", param="fail_status")
        for key, value in body.items():
            setattr(self, key, value)

    def take_failure(self, raw: bytes = b"") -> int | None:
        """The status to fail this request with, if a failure is still due."""
        if self.fail_marker and self.fail_marker.encode() in raw:
            return self.fail_status
        if self.fail_next_n <= 0:
            return None
        self.fail_next_n -= 1
        return self.fail_status

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
