"""`Cut`: the wrapper's ``masking`` and ``level`` options are read in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from sdp_train.errors import ConfigError
from sdp_train.parallel.masking import Cut

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = ("layers.0", "layers.1", "layers.2")
ROW = np.array([1, 0, 1])


@pytest.mark.parametrize(("masking", "level", "kind", "running"), [
    ("forward", "block", "moves_blocks", ("layers.0", "layers.2")),
    ("forward", "neuron", "slices_neurons", BLOCKS),
    ("backward", "block", "keeps_whole_model", BLOCKS),
])
def test_each_valid_cut_is_exactly_one_kind_and_runs_its_blocks(masking, level, kind, running):
    cut = Cut(masking, level)
    kinds = {k for k in ("moves_blocks", "slices_neurons", "keeps_whole_model") if getattr(cut, k)}
    assert kinds == {kind}
    held = cut.held_blocks(BLOCKS, ROW)
    assert held == (BLOCKS if level == "neuron" else ("layers.0", "layers.2"))
    assert cut.running_blocks(BLOCKS, held) == running


@pytest.mark.parametrize(("masking", "level", "message"), [
    ("backward", "neuron", "backward masking works at level 'block' only"),
    ("sideways", "block", "masking must be one of"),
    ("forward", "layer", "level must be 'block' or 'neuron'"),
])
def test_an_invalid_cut_is_refused(masking, level, message):
    with pytest.raises(ConfigError, match=message):
        Cut(masking, level)


def test_no_module_but_masking_compares_the_masking_option_to_a_string():
    found = []
    for path in sorted((ROOT / "sdp_train").rglob("*.py")):
        if path == ROOT / "sdp_train" / "parallel" / "masking.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(getattr(s, "id", getattr(s, "attr", None)) == "masking" for s in sides)
                if named and any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
