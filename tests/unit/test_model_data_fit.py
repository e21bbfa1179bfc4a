"""`prepare` refuses a model whose inputs or outputs cannot match the data, before any rank starts
(otherwise every rank crashes at step 0 with an index or shape error from torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdp_train.data import build_batches
from sdp_train.errors import ConfigError
from sdp_train.models import build_model
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import loss_fn


@pytest.mark.parametrize(
    ("model", "overrides", "message"),
    [
        ("llama-debug", {"vocab_size": 100}, "vocab_size=100; the stdlib byte data needs at least 256"),
        ("resnet18-cifar", {"num_classes": 5}, "num_classes=5; digits has 10 classes"),
        ("resnet18-cifar", {"in_channels": 3}, "in_channels=3; digits images have 1"),
        ("vit-tiny", {"patch_size": 3}, "patch_size=3, which does not divide the 8 x 8 digits images"),
        ("swin-debug", {"image_size": 32}, "image_size=32; digits images are 8 x 8"),
        ("swin-debug", {"window": 3}, "window=3 must divide stage 0's 4 x 4 token map (image_size=8"),
        ("swin-tiny", {}, "patch merging after stage 2 needs an even token map, got 1 x 1 .image_size=8, "
                          "patch_size=2.: the images of --data auto are 8 x 8; --data cifar:DIR gives 32 x 32 ones"),
    ],
)
def test_model_that_cannot_fit_the_data_is_refused(model, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        prepare(TrainConfig(model=model, mode="ddp", model_overrides=overrides))


@pytest.mark.parametrize("model", ["llama-debug", "resnet18-cifar", "vit-tiny", "swin-debug"])
def test_models_that_fit_their_data_run_a_forward_pass_on_it(model):
    prep = prepare(TrainConfig(model=model, mode="ddp", batch_size=2, seq_len=16, max_data_bytes=50_000))
    inputs, targets = next(build_batches(prep.data, split="train", seed=0, rank=0, world_size=1))
    logits = build_model(prep.model_config, seed=0)(inputs)
    classes = getattr(prep.model_config, "vocab_size", None) or prep.model_config.num_classes
    assert logits.shape == (*targets.shape, classes)
    assert int(targets.max()) < classes
    assert torch.isfinite(loss_fn(logits, targets))


def test_cifar_data_sets_the_channels_and_the_image_side_of_a_model_built_for_one_size(tmp_path):
    for name in ("data_batch_1", "test_batch"):  # prepare checks that the files exist, it reads none
        (tmp_path / name).write_bytes(b"")
    # patch_size=16 fits 32 x 32 images only: overrides are checked at the data's image side
    cifar = prepare(TrainConfig(model="swin-debug", mode="ddp", data=f"cifar:{tmp_path}",
                                model_overrides={"patch_size": 16}))
    assert (cifar.model_config.in_channels, cifar.model_config.image_size) == (3, 32)
    digits = prepare(TrainConfig(model="swin-debug", mode="ddp")).model_config
    assert (digits.in_channels, digits.image_size) == (1, 8)


def test_token_shards_without_validation_files_are_refused_before_training(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train_000.bin")
    with pytest.raises(ConfigError, match=r"no validation files \(val\*\.bin\)"):
        prepare(TrainConfig(mode="ddp", data=f"bin:{tmp_path}"))
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "val_000.bin")
    assert prepare(TrainConfig(mode="ddp", data=f"bin:{tmp_path}")).data.val_files
