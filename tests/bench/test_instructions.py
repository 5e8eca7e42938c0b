"""bench/instructions.py's sources: baselines from git, in order, beside this checkout."""

from __future__ import annotations

import subprocess

from bench import instructions
from tests.harness import REPO_ROOT


def test_baselines_are_unpacked_oldest_first_before_this_checkout() -> None:
    # The same commit twice under two names (a shallow clone has no other): two trees.
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    revisions = [head, "HEAD"]
    with instructions.source_trees(revisions) as trees:
        assert [label for label, _ in trees] == [
            f"baseline {head}", "baseline HEAD", "this checkout",
        ]  # fmt: skip
        assert trees[0][1] != trees[1][1]
        assert trees[-1][1] == REPO_ROOT
        for (_, tree), revision in zip(trees, revisions, strict=False):
            relay = (tree / "kvrelay" / "proxy" / "turn" / "relay.py").read_bytes()
            committed = subprocess.run(
                ["git", "show", f"{revision}:kvrelay/proxy/turn/relay.py"],
                cwd=REPO_ROOT, check=True, capture_output=True,
            ).stdout  # fmt: skip
            assert relay == committed
            assert not (tree / "bench").exists()  # the package only: the bench is this one's
    assert not any(tree.exists() for _, tree in trees[:-1])  # removed afterwards
