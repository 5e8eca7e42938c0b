"""The docs' vLLM command lines (the top README's and docs/) load the real adapter with only
settings it accepts."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.vllm.settings import ADAPTER_KEYS, EXTRA_KEYS
from tests.harness import REPO_ROOT


def _readme_transfer_configs() -> list[dict[str, Any]]:
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    text = "\n".join(path.read_text() for path in docs)
    found = sorted(set(re.findall(r"--kv-transfer-config '(.+?)'$", text, flags=re.MULTILINE)))
    # The shell splices the pod IP in: '..."'"${POD_IP}"'"...' is "${POD_IP}" in the JSON.
    configs = [json.loads(f.replace("'\"${POD_IP}\"'", "${POD_IP}")) for f in found]
    return [c for c in configs if c.get("kv_connector") != "NixlConnector"]


def test_deployment_section_shows_a_cuda_worker() -> None:
    configs = _readme_transfer_configs()
    cuda = [c for c in configs if c["kv_buffer_device"] == "cuda"]
    assert len(cuda) == 1, "the top README's P/D command line (docs/OPERATIONS.md repeats it)"
    assert cuda[0]["kv_role"] == "kv_both"
    assert cuda[0]["kv_load_failure_policy"] in ("recompute", "fail")
    assert "advertise_host" in cuda[0]["kv_connector_extra_config"]


def test_module_path_and_class_exist() -> None:
    for cfg in _readme_transfer_configs():
        module = REPO_ROOT / (cfg["kv_connector_module_path"].replace(".", "/") + ".py")
        assert module.exists(), module
        tree = ast.parse(module.read_text())
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        assert cfg["kv_connector"] in classes


def test_extra_config_keys_are_accepted_by_the_adapter() -> None:
    for cfg in _readme_transfer_configs():
        extra = cfg["kv_connector_extra_config"]
        assert set(extra) <= set(EXTRA_KEYS) | set(ADAPTER_KEYS), set(extra) - set(EXTRA_KEYS)
        # The values build a valid core config (an advertised pod IP stands in for $POD_IP).
        known = {k: v for k, v in extra.items() if k in EXTRA_KEYS}
        if "advertise_host" in known:
            known["advertise_host"] = "10.0.0.7"
        ConnectorConfig(engine_id="p0", **known)
