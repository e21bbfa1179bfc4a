"""Tests that start a child process run it with the test's own interpreter, whatever the install layout."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# A venv path or a bare interpreter name as a child's program: both assume one install layout.
LAYOUT_BOUND = re.compile(
    r"""\.venv|(run|Popen|call|check_output|check_call)\(\s*\[\s*["'](python3?|sdp|torchrun)["']"""
    r"""|["']PYTHON["']\]\s*=\s*["']python"""
)


def test_no_test_starts_an_interpreter_found_by_path_or_venv_layout():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LAYOUT_BOUND.search(line):
                offenders.append(f"{path.relative_to(TESTS)}:{number}: {line.strip()}")
    assert offenders == [], "start children with sys.executable and tests.child_env:\n" + "\n".join(offenders)
