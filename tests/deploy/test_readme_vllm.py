"""The README's vLLM worker command line loads the real adapter with only known settings."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from connector.config import ConnectorConfig
from connector.vllm.settings import ADAPTER_KEYS, EXTRA_KEYS
from tests.harness import REPO_ROOT


def _readme_transfer_config() -> dict[str, Any]:
    readme = (REPO_ROOT / "README.md").read_text()
    found = re.findall(r"--kv-transfer-config '(.+?)'$", readme, flags=re.MULTILINE)
    assert len(found) == 1, found
    # The shell splices the pod IP in: '..."'"${POD_IP}"'"...' is "${POD_IP}" in the JSON.
    return dict(json.loads(found[0].replace("'\"${POD_IP}\"'", "${POD_IP}")))


def test_module_path_and_class_exist() -> None:
    cfg = _readme_transfer_config()
    module = REPO_ROOT / (cfg["kv_connector_module_path"].replace(".", "/") + ".py")
    assert module.exists(), module
    classes = {n.name for n in ast.parse(module.read_text()).body if isinstance(n, ast.ClassDef)}
    assert cfg["kv_connector"] in classes
    assert cfg["kv_role"] == "kv_both" and cfg["kv_buffer_device"] == "cuda"


def test_extra_config_keys_are_accepted_by_the_adapter() -> None:
    cfg = _readme_transfer_config()
    extra = cfg["kv_connector_extra_config"]
    assert set(extra) <= set(EXTRA_KEYS) | set(ADAPTER_KEYS), set(extra) - set(EXTRA_KEYS)
    # The values build a valid core config (the advertised host is a placeholder here).
    known = {k: v for k, v in extra.items() if k in EXTRA_KEYS}
    ConnectorConfig(engine_id="p0", **{**known, "advertise_host": "10.0.0.7"})
    assert cfg["kv_load_failure_policy"] in ("recompute", "fail")
