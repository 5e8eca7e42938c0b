"""The code samples in the docs import what they say: every ```python block of a README or of
docs/*.md has its import statements compiled and run, and each imported name must exist, so a
sample that names a moved module or a renamed class fails here instead of in a reader's hands.

Only the imports are run, not the rest of a sample (samples may be fragments: signatures,
`await` outside a function)."""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?:python|py)[ \t]*\n(.*?)^```", re.S | re.M)
SKIP_DIRS = {"node_modules", "build"}


def doc_files(root: Path) -> list[Path]:
    """The repository's READMEs and docs/*.md. Hidden folders (.git, the virtual environments)
    are pruned before they are entered, not filtered after: CI builds .venv-vllm while this
    module is collected, and a walk into a folder pip is rewriting can find it gone."""
    readmes = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in SKIP_DIRS]
        if "README.md" in files:
            readmes.append(Path(folder) / "README.md")
    return sorted(readmes + list((root / "docs").glob("*.md")))


def import_statements(block: str) -> list[str]:
    """The import statements of a sample, one source string each (parenthesised ones whole)."""
    lines = block.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if re.match(r"\s*(from\s+\S+\s+import\b|import\s)", lines[i]):
            statement = lines[i].strip()
            while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                i += 1
                statement += "\n" + lines[i].strip()
            out.append(statement)
        i += 1
    return out


def check_import(statement: str) -> None:
    """Compile one import statement, import its module and look up every name it takes."""
    tree = ast.parse(statement)  # a SyntaxError fails the sample
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"a relative import in a sample: {statement!r}"
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                if alias.name == "*":
                    continue
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
        else:
            raise AssertionError(f"not an import: {statement!r}")


def samples(root: Path) -> list[tuple[str, str]]:
    out = []
    for path in doc_files(root):
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for statement in import_statements(match.group(1)):
                out.append((f"{path.relative_to(root)}:{line}", statement))
    return out


SAMPLES = samples(ROOT)


def test_the_docs_have_import_samples() -> None:
    files = {where.split(":")[0] for where, _ in SAMPLES}
    assert "kvrelay/kvcache_map/README.md" in files and "kvrelay/connector/README.md" in files


@pytest.mark.parametrize(("where", "statement"), SAMPLES, ids=[w for w, _ in SAMPLES])
def test_sample_imports_resolve(where: str, statement: str) -> None:
    check_import(statement)


def test_a_stale_sample_fails(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "X.md").write_text(
        "text\n```python\nfrom kvcache_map import KVEntry\nx = 1\n```\n"
        "```python\nfrom kvrelay.kvcache_map import (\n    KVEntry,\n    NoSuchName,\n)\n```\n"
        "```bash\nfrom nothing import here\n```\n"
    )
    found = samples(tmp_path)
    assert found == [
        ("docs/X.md:2", "from kvcache_map import KVEntry"),
        ("docs/X.md:6", "from kvrelay.kvcache_map import (\nKVEntry,\nNoSuchName,\n)"),
    ]
    with pytest.raises(ModuleNotFoundError):
        check_import(found[0][1])
    with pytest.raises(ModuleNotFoundError):
        check_import(found[1][1])
