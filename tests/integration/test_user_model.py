"""``sdp train --model FILE.py:FACTORY``: a user's own model trains through the library API.

Bad models are refused before any process starts, in one line naming what is wrong and where. A
real 2-rank B-SDP run of a Hugging Face ``LlamaForCausalLM`` built by examples/sdp_train_models.py
keeps the holders of every shared tensor bit-identical (optimizer state included), and writes a
full model that ``from_pretrained`` loads and that scores the validation loss summary.json reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import validation_sums
from sdp_train.trainer.user_model import UserModel, logits_of
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sdp_train_models.py"


def _refused(capsys, argv, message):
    assert main(["train", "--workers", "2", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp train: error:"), err
    assert message in err[0], err[0]


BAD_MODELS = {
    "raises.py": "def build():\n    raise RuntimeError('no GPU here')\n",
    "not_a_module.py": "def build():\n    return 42\n",
    "broken_import.py": "import not_a_real_package_name\n",
    "wrong_logits.py": ("import torch\n"
                        "class M(torch.nn.Module):\n"
                        "    def __init__(self):\n"
                        "        super().__init__()\n"
                        "        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))\n"
                        "    def forward(self, x):\n"
                        "        x = x.flatten(1)\n"
                        "        for layer in self.layers:\n"
                        "            x = x + layer(x)\n"
                        "        return x[:, :5]\n"
                        "def build():\n    return M()\n"),
}


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("missing.py:build", [], "missing.py is not a file"),
        ("EXAMPLE", [], "name the function that builds the model, as FILE.py:FACTORY"),
        ("EXAMPLE:no_such_factory", [], "defines no 'no_such_factory'; its functions and classes: Block, ByteLM"),
        ("EXAMPLE:Block", [], "Block() raised TypeError"),
        ("raises.py:build", [], "build() raised RuntimeError: no GPU here"),
        ("not_a_module.py:build", [], "build() returned int, not a torch.nn.Module"),
        ("broken_import.py:build", [], "raised ModuleNotFoundError: No module named 'not_a_real_package_name'"),
        ("EXAMPLE:byte_lm", ["--data", "digits"], "fails on a batch of digits images (2, 1, 8, 8)"),
        ("wrong_logits.py:build", [], "returns logits of shape (2, 5) for digits images (2, 1, 8, 8); "
                                      "expected (2, N) with N >= 10 classes"),
        ("EXAMPLE:byte_lm", ["--blocks", "trunk.*"], "blocks='trunk.*' matches no submodule of ByteLM; "
                                                     "its block lists are: blocks.* (4 x Block)"),
        ("EXAMPLE:byte_lm", ["--blocks", "blocks.0"], "SDP needs at least 2 maskable blocks"),
        ("llama-debug", ["--blocks", "layers.*"], "the blocks of model 'llama-debug' are fixed by its family"),
    ],
)
def test_bad_user_models_are_one_clear_line_before_launch(tmp_path, capsys, model, extra, message):
    for name, text in BAD_MODELS.items():
        (tmp_path / name).write_text(text)
    model = model.replace("EXAMPLE", str(EXAMPLE))
    if not model.startswith(("/", "llama")):
        model = str(tmp_path / model)
    out = tmp_path / "run"
    _refused(capsys, ["--model", model, "--out", str(out), *extra], message)
    assert not out.exists()


def test_user_model_prepares_its_layout_mask_and_data_kind():
    text = prepare(TrainConfig(model=f"{EXAMPLE}:byte_lm", model_overrides={"depth": 6}, workers=3, active=2 / 3))
    assert isinstance(text.model_config, UserModel) and text.model_config.data == "text"
    assert text.data.dataset == "stdlib-bytes" and text.mask.matrix.shape == (3, 6)
    assert text.mask.block_names == tuple(f"blocks.{i}" for i in range(6))
    images = prepare(TrainConfig(model=f"{EXAMPLE}:digits_classifier", mode="nsdp", workers=2))
    assert images.data.dataset == "digits" and images.mask.matrix.shape == (2, 4 * 4)  # 4 blocks x 4 groups
    named = prepare(TrainConfig(model=f"{EXAMPLE}:byte_lm", blocks="blocks.1, blocks.3", workers=2, active=1.0))
    assert named.mask.block_names == ("blocks.1", "blocks.3")
    assert prepare(TrainConfig(model=f"{EXAMPLE}:byte_lm", mode="ddp", active=None)).mask is None
    with pytest.raises(ConfigError, match=r"byte_lm\(\*\*\{'depht': 2\}\) raised TypeError"):
        prepare(TrainConfig(model=f"{EXAMPLE}:byte_lm", model_overrides={"depht": 2}))


def test_logits_are_taken_from_the_output_types_people_return():
    logits = torch.randn(2, 3)
    assert logits_of(logits) is logits
    assert logits_of({"logits": logits}) is logits and logits_of((logits, None)) is logits
    assert logits_of(type("Out", (), {"logits": logits})()) is logits
    with pytest.raises(TypeError, match="sdp train needs logits"):
        logits_of([None])


@pytest.mark.slow
def test_hugging_face_llama_trains_with_bsdp_through_sdp_train(tmp_path):
    """One 2-rank launch: holders identical, export reloads with from_pretrained, validation loss agrees."""
    from transformers import LlamaForCausalLM

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "train", "--model", f"{EXAMPLE}:hf_llama", "--mode", "bsdp",
         "--workers", "2", "--active", "0.5", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
         "--max-data-bytes", "100000", "--eval-batches", "1", "--checkpoint-every", "3", "--memory-steps", "0",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(TRITON_INTERPRET="0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mask"]["rows"] == ["1100", "0011"]
    ranks = [torch.load(out / "checkpoints" / "step_3" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    shared = sorted(set(ranks[0]["model"]) & set(ranks[1]["model"]))
    assert "model.embed_tokens.weight" in shared and not any(".layers." in n for n in shared)
    for name in shared:  # held by both workers: averaged, so bit-identical
        assert torch.equal(ranks[0]["model"][name], ranks[1]["model"][name]), name
    moments = [_adam_state_by_name(state) for state in ranks]
    for name in shared:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[0][name][key], moments[1][name][key]), (name, key)
    assert moments[0]["model.embed_tokens.weight"]["exp_avg"].abs().sum() > 0  # a test that can fail
    # the export: a Hugging Face directory (config.json + model.safetensors) with every key
    model = LlamaForCausalLM.from_pretrained(out)
    prep = prepare(TrainConfig.from_dict(summary["config"]))
    sums = validation_sums(model, prep, world_size=2, device=torch.device("cpu"))
    assert float(sums[0] / sums[1]) == pytest.approx(summary["final_val_loss"], rel=1e-5)


def _adam_state_by_name(rank_file: dict) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW moments by parameter name: sdp train's groups are the >= 2-D tensors, then the others."""
    names = list(rank_file["model"])
    order = [n for n in names if rank_file["model"][n].dim() >= 2] + [n for n in names if rank_file["model"][n].dim() < 2]
    return {order[i]: state for i, state in rank_file["optimizer"]["state"].items()}


def test_commands_that_need_a_built_in_model_say_so(capsys):
    assert main(["plan", "--model", f"{EXAMPLE}:byte_lm", "--workers", "2", "--memory-per-device", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "is your own (FILE.py:FACTORY): sdp train takes it" in err and "llama-debug" in err
