"""`kv_transfer_params` smuggled inside `vllm_xargs` never reach real vLLM behind the proxy.

vLLM copies `vllm_xargs` into the sampling params' `extra_args`, where its scheduler looks up
`kv_transfer_params`: a string there made `/v1/responses` answer 500 (the scheduler called
`.get` on it). Through the proxy, the field is stripped on every route, so both the
pass-through route and a chat turn answer normally, and the engines serve on.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.devtools import vllm_servers
from tests.vllm.conftest import PDFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SMUGGLED = {"kv_transfer_params": "x"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "hello there", "max_output_tokens": 4}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}),
        ("/v1/completions", {"prompt": "hello there", "max_tokens": 4}),
    ],
    ids=["responses", "chat", "completions"],
)  # fmt: skip
def test_kv_transfer_params_inside_vllm_xargs_are_stripped(
    kvrelay_fleet: PDFleet, path: str, body: dict[str, Any]
) -> None:
    full = {"model": vllm_servers.MODEL_NAME, "temperature": 0, **body, "vllm_xargs": SMUGGLED}
    status, out, _ = kvrelay_fleet.proxy.call("POST", path, full, timeout=120)
    assert status == 200, out
    # Both engines are unharmed: a plain turn is served after it.
    plain = {k: v for k, v in full.items() if k != "vllm_xargs"}
    again, answer, _ = kvrelay_fleet.proxy.call("POST", path, plain, timeout=120)
    assert again == 200, answer
