"""Real vLLM's answer to text that cannot be encoded (a lone surrogate, valid as a JSON escape): a
400 BadRequestError, not a 5xx. enginesim copies this (`kvrelay.enginesim.openai_api.encode_text`)
and the proxy's health judgement relies on such input not looking like an engine failure.

Uses only the session's reference server (no extra engine launch).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.devtools import vllm_servers
from tests.vllm.conftest import Reference

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "a\udfffb", "max_tokens": 2}),
    ],
    ids=["chat", "completions"],
)  # fmt: skip
def test_vllm_refuses_a_lone_surrogate_with_400(
    reference_launch: Reference, path: str, body: dict[str, Any]
) -> None:
    reference = reference_launch.server()
    status, out = reference.post(path, {"model": vllm_servers.MODEL_NAME, "temperature": 0, **body})
    assert status == 400, out
    assert out["error"]["type"] == "BadRequestError", out
    # The server is unharmed: the next request is served.
    clean = {**body, "prompt": "hello"} if "prompt" in body else \
        {**body, "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    ok, answer = reference.post(path, {"model": vllm_servers.MODEL_NAME, "temperature": 0, **clean})
    assert ok == 200, answer
