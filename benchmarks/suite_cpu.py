"""Where the test suite's CPU time goes: a pytest plugin that records, per test, the CPU seconds of
the pytest process and of the child processes it waited for (ranks, launchers, CLI calls).

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -n 2 --dist loadscope -p suite_cpu
    .venv/bin/python benchmarks/suite_cpu.py            # the report: per module, then per test

Each xdist worker appends one JSON line per test to ``$SUITE_CPU_OUT`` (default
``suite_cpu.jsonl`` in the working directory). A child is counted when it is reaped, so a process
that outlives its test is charged to the test that reaps it: a test with far more CPU than wall
time points at a process left running. The suite runs on 2 cores, so its wall time is about half
its CPU time; BENCHMARKS.md ("Suite CPU time") has a measured breakdown.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest

OUT = os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, children0 = _cpu()
    start = time.monotonic()
    yield
    own1, children1 = _cpu()
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "self": own1 - own0, "children": children1 - children0,
                            "wall": time.monotonic() - start}) + "\n")


def report(path: str = OUT, top: int = 25) -> str:
    """Modules by CPU seconds, then the most expensive tests (the last record of each test wins)."""
    rows = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            rows[row["id"]] = row
    cpu = {k: r["self"] + r["children"] for k, r in rows.items()}
    modules, walls, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for k, r in rows.items():
        module = k.split("::")[0]
        modules[module] += cpu[k]
        walls[module] += r["wall"]
        counts[module] += 1
    lines = [f"{len(rows)} tests, {sum(cpu.values()):.0f} CPU-s "
             f"({sum(r['children'] for r in rows.values()):.0f} in child processes)", "",
             "CPU-s  wall-s  tests  module"]
    lines += [f"{v:6.1f} {walls[m]:7.1f} {counts[m]:6d}  {m}" for m, v in modules.most_common(top)]
    lines += ["", "CPU-s  wall-s  test"]
    lines += [f"{cpu[k]:6.1f} {rows[k]['wall']:7.1f}  {k}" for k in sorted(cpu, key=cpu.get, reverse=True)[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(*sys.argv[1:2]))
