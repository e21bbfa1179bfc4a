"""``--data`` is one of ``auto``, ``stdlib``, ``digits``, ``bin:DIR`` or ``cifar:DIR``: anything else
is refused naming the argument (before, ``stdlib:x`` trained on stdlib bytes and ignored ``x``), and
token shards holding an id beyond the model's vocabulary are refused before launch naming the shard
(before, the ranks ended in ``IndexError: index out of range in self``)."""

from __future__ import annotations

import numpy as np
import pytest

from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare

USER_LM = """
import torch

class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)

def make():
    return LM()
"""


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
    (tmp_path / "m.py").write_text(USER_LM.replace("VOCAB", "256"))
    with pytest.raises(ConfigError, match=r"data 'stdlib:x' \(--data\): stdlib takes no argument"):
        prepare(TrainConfig(model=f"{tmp_path / 'm.py'}:make", mode="ddp", data="stdlib:x"))


def test_bin_data_with_a_directory_is_still_read(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train_000.bin")
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "val_000.bin")
    prep = prepare(TrainConfig(mode="ddp", data=f"bin:{tmp_path}", model_overrides={"vocab_size": 1000}))
    assert prep.data.dataset == "token-bin" and prep.data.val_files == (str(tmp_path / "val_000.bin"),)


def _shards(root, train_ids, val_ids):
    root.mkdir()
    np.asarray(train_ids, dtype=np.uint16).tofile(root / "train_000.bin")
    np.asarray(val_ids, dtype=np.uint16).tofile(root / "val_000.bin")
    return root


TINY_TRAIN = ["--mode", "ddp", "--workers", "1", "--steps", "1", "--batch-size", "2", "--seq-len", "8",
              "--eval-batches", "1", "--memory-steps", "0", "--no-save"]


@pytest.mark.parametrize(("where", "file"), [("train", "train_000.bin"), ("val", "val_000.bin")])
def test_token_ids_beyond_the_vocabulary_are_refused_before_launch_naming_the_shard(tmp_path, capsys, where, file):
    ids = np.arange(2000) % 256  # llama-debug embeds 256 ids
    bad = ids.copy()
    bad[1234] = 50256  # a GPT-2 id
    data = _shards(tmp_path / "shards", bad if where == "train" else ids, bad if where == "val" else ids)
    from sdp_train.cli import main

    assert main(["train", *TINY_TRAIN, "--data", f"bin:{data}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("sdp train: error: "), err
    assert f"token id 50256 at position 1234 of {data / file}" in err[0]
    assert "vocab_size=256" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_token_ids_beyond_a_user_models_embedding_are_refused(tmp_path, capsys):
    (tmp_path / "m.py").write_text(USER_LM.replace("VOCAB", "100"))
    data = _shards(tmp_path / "shards", np.arange(2000) % 100, np.arange(2000) % 101)
    from sdp_train.cli import main

    assert main(["train", *TINY_TRAIN, "--model", f"{tmp_path / 'm.py'}:make", "--data", f"bin:{data}",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"token id 100 at position 100 of {data / 'val_000.bin'}" in err[0], err
    assert "vocab_size=100" in err[0] or "100 token ids" in err[0]


def test_sdp_estimate_refuses_token_ids_beyond_the_vocabulary(tmp_path, capsys):
    data = _shards(tmp_path / "shards", [7, 300] * 1000, np.arange(2000) % 256)
    from sdp_train.cli import main

    code = main(["estimate", "--mode", "bsdp", "--workers", "2", "--batch-size", "2", "--seq-len", "8",
                 "--data", f"bin:{data}", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"token id 300 at position 1 of {data / 'train_000.bin'}" in err[0], err
    assert not (tmp_path / "c.json").exists()
