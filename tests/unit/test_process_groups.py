"""Every holder-set process group gets the collective timeout, whichever path creates it.

Runs in one process: ``torch.distributed.new_group`` is replaced by a recorder, so the test sees
each group's ranks and timeout without a rendezvous. The sync engine's groups and the FSDP
meshes of holder sets (B-SDP + FSDP, built-in models and the API alike) go through one creator;
a path that called ``new_group`` without ``timeout=`` would leave that run waiting for a dead
peer for torch's default 30 minutes instead of ``SDP_COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from sdp_train.parallel import sync
from sdp_train.parallel.blockmap import SliceSpec

ROOT = Path(__file__).resolve().parents[2]
MATRIX = np.array([[1, 1, 0, 1],
                   [1, 0, 1, 1],
                   [0, 1, 1, 1]], dtype=np.uint8)  # holder sets {0,1}, {0,2}, {1,2}, and all
TIMEOUT_S = 7.0


@pytest.fixture
def created(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``new_group`` call; each call returns a fresh token."""
    calls: list[dict] = []

    def new_group(*args, **kwargs):
        assert not args, "ranks and timeout are passed by keyword"
        calls.append(kwargs)
        return object()

    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: group))
    return calls


def assert_timeouts(calls: list[dict], expected_ranks: list[list[int]]) -> None:
    assert sorted(c["ranks"] for c in calls) == sorted(expected_ranks)
    assert all(c.get("timeout") == timedelta(seconds=TIMEOUT_S) for c in calls), calls


def test_sync_engine_groups_get_the_collective_timeout(created):
    held_by_rank = [{f"b{j}": SliceSpec() for j in range(4) if MATRIX[k, j]} for k in range(3)]
    plans = sync.plan_buckets(held_by_rank, ["b0", "b1", "b2", "b3"])
    groups = sync.create_groups(plans, world_size=3)
    assert set(groups) == {(0, 1), (0, 2), (1, 2), (0, 1, 2)}
    assert_timeouts(created, [[0, 1], [0, 2], [1, 2]])


def test_singleton_holder_sets_get_a_group_only_where_fsdp_needs_one(created):
    singles = [(0,), (1,), (0, 1)]
    engine_groups = sync.holder_set_groups(singles, world_size=3, singletons=False)
    assert engine_groups[(0,)] is None and engine_groups[(1,)] is None
    fsdp_groups = sync.holder_set_groups(singles, world_size=3, singletons=True)
    assert fsdp_groups[(0,)] is not None
    assert_timeouts(created, [[0, 1], [0], [0, 1], [1]])


def test_one_function_in_the_project_creates_process_groups():
    """A second creator is how a group without the timeout came about; there is one."""
    callers = []
    for path in sorted([*ROOT.joinpath("sdp_train").rglob("*.py"), *ROOT.joinpath("kernels").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "new_group"):
                        callers.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert sorted(set(callers)) == ["sdp_train/parallel/sync.py:holder_set_groups"]
