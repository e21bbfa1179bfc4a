"""Test modules are collected by basename (the test folders are not packages): two of one name break collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_basename():
    by_name = defaultdict(list)
    for folder in ("tests", "masklab", "theory", "kernels", "sdp_train"):
        for path in (ROOT / folder).rglob("test_*.py"):
            by_name[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
