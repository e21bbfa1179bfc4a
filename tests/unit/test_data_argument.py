"""``--data`` is one of ``auto``, ``stdlib``, ``digits``, ``bin:DIR`` or ``cifar:DIR``: anything else
is refused naming the argument (before, ``stdlib:x`` trained on stdlib bytes and ignored ``x``)."""

from __future__ import annotations

import numpy as np
import pytest

from sdp_train.config import TrainConfig
from sdp_train.errors import ConfigError
from sdp_train.prepare import prepare


@pytest.mark.parametrize(("data", "model", "message"), [
    ("stdlib:x", "llama-debug", "data 'stdlib:x' (--data): stdlib takes no argument, got 'x'"),
    ("stdlib:", "llama-debug", "data 'stdlib:' (--data): stdlib takes no argument, got ''"),
    ("auto:/tmp", "llama-debug", "data 'auto:/tmp' (--data): auto takes no argument, got '/tmp'"),
    ("digits:10", "resnet18-cifar", "data 'digits:10' (--data): digits takes no argument, got '10'"),
    ("bin:", "llama-debug", "data 'bin:' (--data): bin:DIR needs the directory of its shards"),
    ("cifar:", "resnet18-cifar", "data 'cifar:' (--data): cifar:DIR needs the directory of its batches"),
    ("zzz", "llama-debug", "data 'zzz' (--data) is not one of auto, stdlib, digits, bin:DIR, cifar:DIR"),
    ("stdlib-bytes", "llama-debug", "data 'stdlib-bytes' (--data) is not one of"),
    ("Stdlib", "llama-debug", "data 'Stdlib' (--data) is not one of"),
])
def test_unknown_data_arguments_are_refused_naming_them(data, model, message):
    with pytest.raises(ConfigError) as err:
        prepare(TrainConfig(model=model, mode="ddp", data=data))
    assert message in str(err.value)


@pytest.mark.parametrize(("data", "model"), [("auto", "llama-debug"), ("stdlib", "llama-debug"),
                                             ("digits", "resnet18-cifar"), ("auto", "resnet18-cifar")])
def test_the_plain_data_sources_are_accepted(data, model):
    prep = prepare(TrainConfig(model=model, mode="ddp", data=data, max_data_bytes=50_000))
    assert prep.data.dataset == ("digits" if "resnet" in model else "stdlib-bytes")


def test_a_user_model_refuses_an_argument_to_stdlib_too(tmp_path):
    (tmp_path / "m.py").write_text("import torch\n"
                                   "def make():\n"
                                   "    return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))\n")
    with pytest.raises(ConfigError, match=r"data 'stdlib:x' \(--data\): stdlib takes no argument"):
        prepare(TrainConfig(model=f"{tmp_path / 'm.py'}:make", mode="ddp", data="stdlib:x"))


def test_bin_data_with_a_directory_is_still_read(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train_000.bin")
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "val_000.bin")
    prep = prepare(TrainConfig(mode="ddp", data=f"bin:{tmp_path}", model_overrides={"vocab_size": 1000}))
    assert prep.data.dataset == "token-bin" and prep.data.val_files == (str(tmp_path / "val_000.bin"),)
