"""Per-block torch.compile of SDP on real gloo ranks: the holder-set all_reduces still start while
backward produces gradients, and the loss and averaged gradients equal the eager run's."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import run_rank_script

pytestmark = pytest.mark.slow

MODES = ("bsdp", "nsdp", "bbsdp")


def test_compiled_blocks_keep_overlap_and_equal_eager_gradients(tmp_path):
    # aot_eager traces each block into one forward and one backward graph, as inductor does, without
    # generating code (tests/unit/test_compile_blocks_unit.py runs inductor itself)
    cases = [{"mode": m, "compile": c} for m in MODES for c in (None, "aot_eager")]
    run_rank_script(2, "overlap", {"cases": cases}, tmp_path)
    for i in range(0, len(cases), 2):
        for r in range(2):
            events = json.loads((tmp_path / f"overlap{i + 1}_rank{r}.json").read_text())
            last_grad = len(events) - 1 - events[::-1].index("grad")
            assert "launch" in events and events.index("launch") < last_grad, (cases[i + 1], r, events)
            eager = torch.load(tmp_path / f"overlap{i}_rank{r}.pt")
            compiled = torch.load(tmp_path / f"overlap{i + 1}_rank{r}.pt")
            assert compiled["graphs"] >= 1  # dynamo captured the blocks (the count is cumulative)
            torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
            assert compiled["grads"].keys() == eager["grads"].keys() and eager["grads"]
            for name, grad in eager["grads"].items():
                torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
