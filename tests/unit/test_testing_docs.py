"""docs/testing.md: its worked example runs, and its tests pass (and catch what they claim to)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def _example_namespace() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, f"docs/testing.md should have one runnable python example, found {len(blocks)}"
    namespace: dict = {"__name__": "docs_testing_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace


EXAMPLE = _example_namespace()
EXAMPLE_TESTS = sorted(name for name in EXAMPLE if name.startswith("test_"))


def test_docs_example_defines_its_property_tests():
    assert EXAMPLE_TESTS == ["test_a_subnetwork_that_forgets_a_neuron_is_caught", "test_tiny_mlp_subnetworks_and_sdp_step"]


@pytest.mark.parametrize("name", EXAMPLE_TESTS)
def test_docs_example_test_passes(name):
    EXAMPLE[name]()


def test_docs_example_property_fails_for_a_subnetwork_that_loses_the_shared_bias():
    original = EXAMPLE["subnetwork"]

    def no_bias(model, held):
        sub = original(model, held)
        sub.fc2.bias.data.zero_()
        return sub

    EXAMPLE["subnetwork"] = no_bias
    try:
        with pytest.raises(AssertionError, match="differs from the full model with blocks"):
            EXAMPLE["test_tiny_mlp_subnetworks_and_sdp_step"]()
    finally:
        EXAMPLE["subnetwork"] = original
