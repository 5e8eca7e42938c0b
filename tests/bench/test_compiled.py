"""Which modules `bench/_compiled.py` hands to mypyc: the per-turn packages but their faces and
the modules mypyc cannot compile as written, each of which must still exist (a stale entry
would silently compile nothing less)."""

from __future__ import annotations

from pathlib import Path

from bench import _common as c
from bench import _compiled


def test_the_turn_and_fleet_packages_are_compiled_but_their_faces_and_the_known_misfits() -> None:
    modules = _compiled.compiled_modules(c.REPO_ROOT)
    assert "kvrelay/proxy/turn/relay.py" in modules
    assert "kvrelay/proxy/fleet/routing.py" in modules
    assert "kvrelay/proxy/fleet/hold_payoff.py" in modules
    assert not [m for m in modules if m.endswith("__init__.py")]
    assert not set(modules) & set(_compiled.NOT_COMPILED)
    assert all(m.startswith(_compiled.COMPILED_PACKAGES) for m in modules)


def test_every_module_left_interpreted_still_exists_and_says_why() -> None:
    for module, why in _compiled.NOT_COMPILED.items():
        assert (c.REPO_ROOT / module).is_file(), module
        assert why


def test_a_package_module_is_listed_relative_to_the_root_it_was_found_under(
    tmp_path: Path,
) -> None:
    for package in _compiled.COMPILED_PACKAGES:
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "step.py").write_text("")
    (tmp_path / "kvrelay/proxy/turn/answer.py").write_text("")
    assert _compiled.compiled_modules(tmp_path) == [
        "kvrelay/proxy/turn/step.py",
        "kvrelay/proxy/fleet/step.py",
    ]
