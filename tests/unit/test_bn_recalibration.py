"""The assembled full model's BatchNorm statistics are recomputed over training batches before it is
validated (``bn_recalibration``): under B-/N-SDP each block's statistics come from its holders'
subnetworks, and the full model scored near chance on the CPU CIFAR smoke comparison (issue 28)."""

from __future__ import annotations

import pytest
import torch

from sdp_train.data import build_batches
from sdp_train.models import build_model
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import bn_recalibration_batches, recalibrate_batch_norm
from tests.cifar_files import write_cifar_dir


def _prep(root, mode: str = "bsdp", workers: int = 2, active: float = 0.5, **kw):
    return prepare(TrainConfig(model="resnet18-cifar", mode=mode, active=active, workers=workers, batch_size=8,
                               data=f"cifar:{root}", model_overrides={"width_multiplier": 0.0625}, **kw))


@pytest.mark.parametrize("batches", [1, 3])
def test_the_statistics_are_the_average_over_every_ranks_first_training_batches(tmp_path, batches):
    prep = _prep(write_cifar_dir(tmp_path), bn_recalibration=batches)
    model = build_model(prep.model_config, seed=0)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    live = dict(model.state_dict())  # the tensors as assembled: a DDP rank 0 would be training them
    assert recalibrate_batch_norm(model, prep, 2, torch.device("cpu"))
    assert not model.training
    for name, tensor in live.items():  # written into new tensors, never into the assembled ones
        assert torch.equal(tensor, before[name]), name
    # the stem's BatchNorm sees conv1's output: per batch its mean and unbiased variance, then the mean
    means, variances = [], []
    for rank in range(2):
        stream = build_batches(prep.data, split="train", seed=0, rank=rank, world_size=2)
        for _, (images, _) in zip(range(batches), stream.epoch()):
            out = model.conv1(images)
            means.append(out.mean(dim=(0, 2, 3)))
            variances.append(out.var(dim=(0, 2, 3), unbiased=True))
    torch.testing.assert_close(model.bn1.running_mean, torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bn1.running_var, torch.stack(variances).mean(0), rtol=1e-5, atol=1e-6)
    assert int(model.bn1.num_batches_tracked) == 2 * batches
    assert model.bn1.momentum == torch.nn.BatchNorm2d(1).momentum  # restored: torch's default, as built


def test_auto_recalibrates_forward_masked_modes_only_and_zero_turns_it_off(tmp_path):
    root = write_cifar_dir(tmp_path)
    assert bn_recalibration_batches(_prep(root).config) == 4  # eval_batches
    assert bn_recalibration_batches(_prep(root, mode="nsdp").config) == 4
    assert bn_recalibration_batches(_prep(root, mode="bbsdp").config) == 0
    assert bn_recalibration_batches(TrainConfig(model="resnet18-cifar", mode="ddp")) == 0
    assert bn_recalibration_batches(TrainConfig(model="resnet18-cifar", mode="ddp", bn_recalibration=2)) == 2
    prep = _prep(root, bn_recalibration=0)
    model = build_model(prep.model_config, seed=0)
    assert not recalibrate_batch_norm(model, prep, 2, torch.device("cpu"))
    assert int(model.bn1.num_batches_tracked) == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_count_is_one_config_error(value):
    from sdp_train.errors import ConfigError

    with pytest.raises(ConfigError, match="bn_recalibration="):
        TrainConfig(model="resnet18-cifar", mode="bsdp", active=0.5, workers=2, bn_recalibration=value)


def test_the_saved_model_holds_the_statistics_its_reported_loss_and_accuracy_use(tmp_path):
    """`evaluate` on rank 0 of one rank: the model file it writes scores exactly the loss and accuracy
    it returns, and the state it was given (a training rank's own tensors) is left as it was."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from sdp_train.trainer.train import evaluate, validation_sums

    prep = _prep(write_cifar_dir(tmp_path / "data"), workers=1, active=1.0)
    trained = build_model(prep.model_config, seed=0)
    state = trained.state_dict()
    before = {n: t.clone() for n, t in state.items()}
    run = SimpleNamespace(info=SimpleNamespace(world_size=1, is_main=True), device=torch.device("cpu"),
                          full_state=lambda: dict(state))
    loss, accuracy = evaluate(run, prep, save_to=tmp_path)
    assert all(torch.equal(state[n], before[n]) for n in state)
    saved = load_file(tmp_path / "model.safetensors")
    assert not torch.equal(saved["bn1.running_mean"], before["bn1.running_mean"])  # recomputed (from zeros)
    model = build_model(prep.model_config, seed=1)
    model.load_state_dict(saved, strict=True)
    sums = validation_sums(model, prep, 1, torch.device("cpu"))
    assert (float(sums[0] / sums[1]), float(sums[2] / sums[3])) == (loss, accuracy)
