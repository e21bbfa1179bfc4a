"""The two scripts in examples/ run as a user would run them: torchrun, 2 CPU ranks, own loop."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import ROOT, torchrun

pytestmark = pytest.mark.slow


def test_custom_model_example_trains_saves_and_reloads_the_full_model(tmp_path):
    proc = torchrun(2, [str(ROOT / "examples" / "train_custom_model.py"), "--steps", "20", "--out", str(tmp_path)])
    assert "this worker holds ('blocks.0', 'blocks.1', 'blocks.2', 'blocks.3')" in proc.stdout
    assert "full model reloaded: validation accuracy" in proc.stdout
    assert (tmp_path / "model.safetensors").is_file()


def test_hugging_face_llama_example_trains_saves_and_reloads_with_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    proc = torchrun(2, [str(ROOT / "examples" / "train_hf_llama.py"), "--steps", "10", "--out", str(tmp_path)])
    assert "full model reloaded: validation loss" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"model.safetensors", "config.json"}
