"""A copy of this checkout's `kvrelay/` whose per-turn code is compiled by mypyc: what
compiling the hot path would buy, counted beside the interpreted proxy (`instructions.py
--compiled`).

The per-turn work of the proxy is spread over many small Python steps (the turn's context,
plan, legs and report; the router's weighing; the hold decisions): no single one is worth
rewriting, and together they are most of what the proxy costs a request beyond aiohttp and
pydantic. mypyc compiles type-annotated modules to C extensions, and kvrelay is typed strictly
already, so the packages a turn runs through (`COMPILED_PACKAGES`) are compiled as they are,
in a temporary copy: the checkout itself is never touched, so no stale extension module can
shadow an edited source file. The copy is a measurement, not a build anyone deploys.

Left interpreted, with why (`NOT_COMPILED`): mypyc refuses some statements and miscompiles one
pattern, found by compiling the packages whole.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from bench import _common as c

COMPILED_PACKAGES = ("kvrelay/proxy/turn", "kvrelay/proxy/fleet")

NOT_COMPILED = {
    # mypyc 2.4: "continue inside try/finally block is unimplemented" (the retry loops).
    "kvrelay/proxy/turn/prefill_leg.py": "continue inside try/finally",
    "kvrelay/proxy/turn/decode_leg.py": "continue inside try/finally",
    # mypyc 2.4 leaves a class-level default of a Protocol-typed attribute undefined
    # (`Relayed.out`): the first non-streamed answer raises AttributeError.
    "kvrelay/proxy/turn/answer.py": "a Protocol-typed class default left undefined",
}


def compiled_modules(root: Path) -> list[str]:
    """The modules of `COMPILED_PACKAGES` under `root` that mypyc compiles, as paths relative
    to `root`: every one but the packages' faces (`__init__.py`, kept interpreted so the
    packages import as before) and `NOT_COMPILED`."""
    found = (
        path.relative_to(root).as_posix()
        for package in COMPILED_PACKAGES
        for path in sorted((root / package).glob("*.py"))
        if path.name != "__init__.py"
    )
    return [module for module in found if module not in NOT_COMPILED]


def build(into: Path) -> Path:
    """Copy this checkout's `kvrelay/` (and the mypy settings mypyc type-checks it with) into
    `into` and compile `compiled_modules` there; returns `into`, the directory to put on
    `PYTHONPATH`. Takes minutes: mypyc type-checks the whole package first."""
    shutil.copytree(
        c.REPO_ROOT / "kvrelay", into / "kvrelay", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy2(c.REPO_ROOT / "pyproject.toml", into / "pyproject.toml")
    modules = compiled_modules(into)
    done = subprocess.run(
        [sys.executable, "-m", "mypyc", *modules],
        cwd=into,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"mypyc failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    missing = [m for m in modules if not _extensions(into, m)]
    if missing:
        raise RuntimeError(f"mypyc built no extension for {missing}")
    return into


def _extensions(root: Path, module: str) -> list[Path]:
    path = root / module
    return sorted(path.parent.glob(path.stem + ".cpython-*.so"))
