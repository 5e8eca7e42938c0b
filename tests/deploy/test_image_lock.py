"""The proxy image's constraints file is current: made from today's pyproject requirements
(its recorded digest) and pinning each of them to a release they allow. Offline: remaking the
file needs the index (scripts/lock_image.py), checking it does not."""

from __future__ import annotations

from packaging.requirements import Requirement

from kvrelay.devtools import image_lock


def _name(req: Requirement) -> str:
    return req.name.lower().replace("_", "-")


def test_lock_was_made_from_the_current_pyproject() -> None:
    digest, _ = image_lock.read_lock()
    assert digest == image_lock.inputs_digest(), (
        f"{image_lock.LOCK_FILE.name} is stale: pyproject's image requirements changed; "
        "run .venv/bin/python scripts/lock_image.py"
    )


def test_every_requirement_is_pinned_to_a_release_it_allows() -> None:
    _, pins = image_lock.read_lock()
    build, runtime = image_lock.image_requirements()
    for text in build + runtime:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux"}):
            continue
        assert _name(req) in pins, f"{req.name} is not pinned in {image_lock.LOCK_FILE.name}"
        assert req.specifier.contains(pins[_name(req)], prereleases=True), (req, pins[_name(req)])
    assert all(version and version[0].isdigit() for version in pins.values())
