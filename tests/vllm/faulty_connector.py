"""Test-only: kvrelay's vLLM connector with worker-side stalls that widen race windows.

`FakeStallingConnector` is `KVRelayConnector` unchanged except for `get_finished` on the
worker side. A test arms a one-shot stall by creating a file in the directory named by
`KVRELAY_FAULT_DIR` (the engine's environment):

- `stall-recv`: the next loads reported finished-receiving are held back (the engine keeps
  stepping, the requests stay WAITING_FOR_REMOTE_KVS) until the test creates `resume-recv`;
  `recv-stalled` appears when the stall starts. Lets a test abort a request mid-load.
- `stall-send`: the next step that reports holds finished-sending blocks inside
  `get_finished` (the scheduler side's side channel keeps serving) until `resume-send`
  exists; `send-stalled` appears when it starts. Lets a test land a side-channel release
  between the scheduler's metadata build and its processing of that step's output.

Stalls wait for the test's file with a bound (`RESUME_TIMEOUT_S`), so a test that fails
before resuming never wedges the engine. Loaded through `kv_connector_module_path`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvrelay.connector.vllm.adapter import KVRelayConnector

RESUME_TIMEOUT_S = 60.0
_POLL_S = 0.02  # how often a blocked step looks for the resume file


class FakeStallingConnector(KVRelayConnector):
    """`KVRelayConnector` whose worker side can hold back its finished reports (see module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get("KVRELAY_FAULT_DIR")
        self._fault_dir = Path(path) if path else None
        self._held_recv: set[str] = set()
        self._recv_deadline = 0.0

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        faults = self._fault_dir
        if faults is None:
            return sending, recving
        recving = self._stall_recv(faults, set(recving or ()))
        if sending and _take(faults / "stall-send"):
            (faults / "send-stalled").write_text("\n".join(sorted(sending)))
            _wait_for(faults / "resume-send")
        return sending, recving

    def _stall_recv(self, faults: Path, recving: set[str]) -> set[str]:
        if recving and _take(faults / "stall-recv"):
            self._held_recv |= recving
            self._recv_deadline = time.monotonic() + RESUME_TIMEOUT_S
            (faults / "recv-stalled").write_text("\n".join(sorted(recving)))
            return set()
        if self._held_recv and (
            (faults / "resume-recv").exists() or time.monotonic() > self._recv_deadline
        ):
            recving |= self._held_recv
            self._held_recv = set()
        return recving


def _take(arm: Path) -> bool:
    """Consume a one-shot arm file; True when it was there."""
    try:
        arm.unlink()
    except FileNotFoundError:
        return False
    return True


def _wait_for(resume: Path) -> None:
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
