"""Image runs report top-1 accuracy beside the validation loss, CIFAR-100's layout and 100 classes
are read, and labels a built-in model cannot classify are refused before launch (issue 28)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from sdp_train.cli.train import check_data
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import validation_sums
from tests.cifar_files import write_cifar_dir


class Guess(nn.Module):
    """Names class `label` for every image."""

    def __init__(self, label: int, classes: int) -> None:
        super().__init__()
        self.label, self.classes = label, classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(images.shape[0], self.classes)
        logits[:, self.label] = 1.0
        return logits


def _config(root, workers: int, classes: int = 10, **kw) -> TrainConfig:
    return TrainConfig(model="resnet18-cifar", mode="ddp", workers=workers, batch_size=8, eval_batches=3,
                       data=f"cifar:{root}", model_overrides={"width_multiplier": 0.0625, "num_classes": classes}, **kw)


@pytest.mark.parametrize(("workers", "label"), [(1, 0), (2, 3), (3, 9)])
def test_accuracy_counts_the_examples_whose_class_the_model_names(tmp_path, workers, label):
    """A model that always names one class is right exactly on that class's share of the examples
    evaluated: every rank's first `eval_batches` batches of the test file, counted from the file itself."""
    root = write_cifar_dir(tmp_path, test=24 * workers)
    prep = prepare(_config(root, workers))
    sums = validation_sums(Guess(label, 10), prep, workers, torch.device("cpu"))
    with open(root / "test_batch", "rb") as f:
        labels = np.asarray(pickle.load(f)[b"labels"])
    # the validation split is interleaved over ranks; each rank scores its first 3 batches of 8: all of them
    assert int(sums[3]) == 3 * 8 * workers == len(labels)
    assert int(sums[2]) == int((labels == label).sum())
    assert int(sums[1]) == 3 * workers


def test_language_models_report_no_accuracy():
    prep = prepare(TrainConfig(model="llama-debug", mode="ddp", batch_size=2, seq_len=16, eval_batches=1,
                               max_data_bytes=400_000))
    from sdp_train.models import build_model

    sums = validation_sums(build_model(prep.model_config, seed=0), prep, 1, torch.device("cpu"))
    assert sums[1] == 1 and sums[2] == sums[3] == 0


def test_cifar100_files_are_read_and_labels_beyond_the_model_are_refused_in_one_line(tmp_path):
    root = write_cifar_dir(tmp_path, classes=100)
    prep = prepare(_config(root, 2, classes=100))
    assert [p.rsplit("/", 1)[-1] for p in prep.data.train_files] == ["train"]
    assert [p.rsplit("/", 1)[-1] for p in prep.data.val_files] == ["test"]
    check_data(prep)
    with pytest.raises(ConfigError, match=r"\(train split\) holds class label 99 but model 'resnet18-cifar' has "
                                          r"num_classes=10; give the model 100 or more classes"):
        check_data(prepare(_config(root, 2, classes=10)))
