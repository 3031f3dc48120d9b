"""prune_trees: the built trees of compiled.build_tree that stay, and the ones removed."""

from __future__ import annotations

import os
import time
from pathlib import Path

from flowsched.compiled import prune_trees


def _tree(cache: Path, name: str, used: float, *, built: bool = True) -> Path:
    tree = cache / name
    (tree / "flowsched").mkdir(parents=True)
    marker = tree / ".built" if built else tree / "flowsched" / "model.py"
    marker.write_text("x")
    os.utime(marker, (used, used))
    os.utime(tree, (used, used))
    return tree


def test_the_most_recently_used_trees_stay(tmp_path: Path) -> None:
    now = time.time()
    ages = {"a": 50, "b": 10, "c": 40, "d": 20, "e": 30}  # seconds since last use
    trees = {name: _tree(tmp_path, name, now - age) for name, age in ages.items()}
    removed = prune_trees(tmp_path, keep=3)
    assert sorted(path.name for path in removed) == ["a", "c"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["b", "d", "e"]
    assert not trees["a"].exists() and trees["b"].exists()


def test_only_dead_staging_folders_go(tmp_path: Path) -> None:
    now = time.time()
    _tree(tmp_path, "old.partial", now - 2 * 86400, built=False)  # a build that died
    _tree(tmp_path, "new.partial", now - 60, built=False)  # another process building now
    _tree(tmp_path, "unknown", now - 2 * 86400, built=False)  # not ours to judge
    _tree(tmp_path, "kept", now)
    removed = prune_trees(tmp_path, keep=1)
    assert [path.name for path in removed] == ["old.partial"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept", "new.partial", "unknown"]


def test_keep_zero_removes_every_built_tree(tmp_path: Path) -> None:
    now = time.time()
    for name in "xyz":
        _tree(tmp_path, name, now)
    assert len(prune_trees(tmp_path, keep=0)) == 3
    assert list(tmp_path.iterdir()) == []
