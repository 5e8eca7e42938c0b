"""The operations guide's environment-variable table equals the one generated from the settings
model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

from kvrelay.proxy.config import Settings, env_name
from tests.harness import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gen_env_table.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_env_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operations_table_is_the_generated_one() -> None:
    gen = _generator()
    readme = (REPO_ROOT / "docs" / "OPERATIONS.md").read_text()
    assert gen.readme_table(readme) == gen.table(), "run: python scripts/gen_env_table.py --write"


def test_table_has_one_row_per_setting_with_its_env_name() -> None:
    rows = [r for r in _generator().table().splitlines() if r.startswith("| `KVRELAY_")]
    assert len(rows) == len(Settings.model_fields)
    for row, name in zip(rows, Settings.model_fields, strict=True):
        assert row.startswith(f"| `{env_name(name)}` |"), row


def test_check_mode_exit_codes() -> None:
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stdout
