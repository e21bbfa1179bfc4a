"""Per-block torch.compile of SDP on real gloo ranks: the holder-set all_reduces start while backward
produces gradients, eager and compiled, and the compiled loss and averaged gradients equal the eager
run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow

MODES = ("bsdp", "nsdp", "bbsdp")
# aot_eager traces each block into one forward and one backward graph, as inductor does, without
# generating code (tests/unit/test_compile_blocks_unit.py runs inductor itself)
CASES = [{"mode": m, "compile": c} for m in MODES for c in (None, "aot_eager")]


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch (`tests.distributed.shared_launch`)."""
    return "overlap", {"cases": CASES}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return shared_out(tmp_path_factory, "test_compile_blocks")


def _overlapped(events: list[str]) -> bool:
    """Some all_reduce was launched before the engine saw the last gradient: communication overlaps backward."""
    last_grad = len(events) - 1 - events[::-1].index("grad")
    return "launch" in events and events.index("launch") < last_grad


@pytest.mark.parametrize("mode", MODES)
def test_first_holder_collective_starts_while_backward_still_produces_gradients(out, mode):
    """Real gloo ranks, designed masks, eager blocks: on every rank some all_reduce is launched
    inside backward, before the engine has seen the last gradient."""
    i = CASES.index({"mode": mode, "compile": None})
    for r in range(2):
        events = json.loads((out / f"overlap{i}_rank{r}.json").read_text())
        assert _overlapped(events), (mode, r, events)


def test_compiled_blocks_keep_overlap_and_equal_eager_gradients(out):
    for i in range(0, len(CASES), 2):
        for r in range(2):
            events = json.loads((out / f"overlap{i + 1}_rank{r}.json").read_text())
            assert _overlapped(events), (CASES[i + 1], r, events)
            eager = torch.load(out / f"overlap{i}_rank{r}.pt")
            compiled = torch.load(out / f"overlap{i + 1}_rank{r}.pt")
            assert compiled["graphs"] >= 1  # dynamo captured the blocks (the count is cumulative)
            torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
            assert compiled["grads"].keys() == eager["grads"].keys() and eager["grads"]
            for name, grad in eager["grads"].items():
                torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
