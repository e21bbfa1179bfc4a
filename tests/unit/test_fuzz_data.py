"""Fuzzed data sets give batches of the documented shapes or one `DataError`/`ConfigError`, never a
numpy/torch/pickle traceback.

``bin:DIR`` gets directories of odd-length, empty and short shards, directories named like shards
and FIFOs; CIFAR batches get truncated pickles, wrong dict shapes, wrong dtypes, NaN images,
ragged lists and negative or huge labels; stdlib and digits get extreme batch sizes and lengths.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_train.data import DataConfig, build_batches, load_cifar_batches
from sdp_train.errors import ConfigError, DataError, DataFileError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SHARD_NAMES = ["a.bin", "b.bin", "c.bin", "val.bin", "val_2.bin", "notes.txt"]


def _check_token_batch(batches, seq_len: int, batch_size: int) -> None:
    inputs, targets = next(batches)
    assert inputs.shape == targets.shape == (batch_size, seq_len) and inputs.dtype == torch.int64
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 2**16
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])


def _streams_or_user_error(cfg: TrainConfig, *, world_size: int, check) -> None:
    """prepare, then each split on each rank: each step works (checked by `check`) or raises one user error."""
    try:
        prep = prepare(cfg)
    except ConfigError:
        return
    for split in ("train", "val"):
        for rank in range(world_size):
            try:
                batches = build_batches(prep.data, split=split, seed=0, rank=rank, world_size=world_size)
            except (ConfigError, DataError) as exc:
                assert cfg.data.split(":", 1)[1] in str(exc) or "has no val_files" in str(exc), str(exc)
                continue
            check(batches)


tokens = st.integers(1, 80).map(lambda n: np.arange(n, dtype="<u2").tobytes())
shard_contents = st.one_of(tokens, tokens, tokens, st.binary(max_size=9), st.binary(min_size=10, max_size=120),
                           st.none())


@given(st.lists(st.tuples(st.sampled_from(SHARD_NAMES), shard_contents), min_size=1, max_size=5,
                unique_by=lambda entry: entry[0]),
       st.integers(1, 20), st.integers(1, 4) | st.just(10**12), st.integers(1, 3), st.booleans())
@FUZZ
def test_token_bin_directories_give_batches_or_one_user_error(tmp_path, entries, seq_len, batch_size, world_size,
                                                              heterogeneous):
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    for name, content in entries:
        if content is None:
            (root / name).mkdir()  # a directory named like a shard
        else:
            (root / name).write_bytes(content)
    cfg = TrainConfig(mode="ddp", workers=world_size, data=f"bin:{root}", seq_len=seq_len, batch_size=batch_size,
                      heterogeneous=heterogeneous)
    _streams_or_user_error(cfg, world_size=world_size, check=lambda b: _check_token_batch(b, seq_len, batch_size))


@pytest.mark.parametrize("kind", ["missing", "a-file", "empty", "only-val", "shard-is-a-directory", "shard-is-a-fifo",
                                  "odd-length", "too-short", "no-val"])
def test_bad_token_bin_directories_are_one_clear_error(tmp_path, kind):
    root = tmp_path / "shards"
    if kind == "a-file":
        root.write_bytes(b"\0\0")
    elif kind != "missing":
        root.mkdir()
        tokens = np.arange(200, dtype="<u2").tobytes()
        files = {"only-val": {"val.bin": tokens}, "odd-length": {"a.bin": tokens + b"\0", "val.bin": tokens},
                 "too-short": {"a.bin": tokens[:4], "val.bin": tokens}, "no-val": {"a.bin": tokens},
                 "shard-is-a-directory": {"val.bin": tokens}, "shard-is-a-fifo": {"val.bin": tokens}}.get(kind, {})
        for name, data in files.items():
            (root / name).write_bytes(data)
        if kind == "shard-is-a-directory":
            (root / "a.bin").mkdir()
        if kind == "shard-is-a-fifo":
            os.mkfifo(root / "a.bin")  # memory-mapping or reading it would block
    cfg = TrainConfig(mode="ddp", workers=1, data=f"bin:{root}", seq_len=8, batch_size=2)
    with pytest.raises((ConfigError, DataError)) as err:
        build_batches(prepare(cfg).data, split="val" if kind == "no-val" else "train", seed=0, rank=0, world_size=1)
    assert ("no validation files (val*.bin)" if kind == "no-val" else str(root)) in str(err.value)


def _array(n: int, shape: tuple[int, ...], dtype, fill) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN cast to an integer dtype is part of the fuzz
        return np.full((n, *shape), fill).astype(dtype)


arrays = st.builds(
    _array,
    st.integers(0, 3), st.sampled_from([(3072,), (3, 32, 32), (), (3071,)]),
    st.sampled_from([np.uint8, np.float32, np.int64, np.uint16, object]),
    st.sampled_from([0, 7, 255, math.nan, -1]),
)
labels = (st.lists(st.integers(-2, 12) | st.sampled_from([2**63, 2**70]), max_size=4)
          | st.lists(st.floats(allow_nan=True), max_size=3) | st.sampled_from([None, "abc", b"x", 3, {1: 2}])
          | st.builds(lambda n, v: np.full(n, v, dtype=np.uint64), st.integers(0, 3), st.sampled_from([0, 2**63 + 5])))


@st.composite
def nearly_valid_batches(draw) -> dict:
    """A CIFAR batch with one part possibly wrong: n images of uint8 and n labels, or a junk replacement."""
    n = draw(st.integers(0, 3))
    batch = {b"data": _array(n, (3072,), np.uint8, draw(st.sampled_from([0, 255]))),
             draw(st.sampled_from([b"labels", b"fine_labels"])): draw(st.lists(st.integers(0, 9), min_size=n,
                                                                                max_size=n))}
    key = draw(st.sampled_from([None, b"data", b"labels", b"fine_labels", "labels"]))
    if key is not None:
        batch[key] = draw(arrays | labels)
    return batch


batches = st.one_of(
    nearly_valid_batches(), nearly_valid_batches(),
    st.fixed_dictionaries({b"data": arrays | st.sampled_from([[[1, 2], [3]], b"raw", None, 7, [[0] * 3072]])},
                          optional={b"labels": labels, b"fine_labels": labels, "labels": labels}),
    st.lists(arrays, max_size=2), st.none(), st.text(max_size=5),
)


@given(batches, st.integers(2, 5), st.one_of(st.none(), st.none(), st.integers(0, 10**6)), st.binary(max_size=12))
@FUZZ
def test_cifar_batches_load_or_give_a_data_file_error_naming_the_file(tmp_path, batch, protocol, cut, noise):
    path = tmp_path / "data_batch_1"
    blob = pickle.dumps(batch, protocol=protocol)
    path.write_bytes(blob if cut is None else blob[: cut % (len(blob) + 1)] + noise)  # truncated or garbled
    try:
        images, labels_out = load_cifar_batches([path])
    except DataFileError as exc:
        assert str(path) in str(exc)
        return
    assert images.dtype == np.uint8 and images.shape[1:] == (3, 32, 32)
    assert labels_out.dtype == np.int64 and labels_out.shape == (len(images),) and (labels_out >= 0).all()


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "empty", "ragged", "nan-images", "negative-label",
                                  "huge-label", "name-too-long"])
def test_bad_cifar_files_are_one_data_file_error(tmp_path, kind):
    path = tmp_path / "data_batch_1"
    good = np.zeros((2, 3072), dtype=np.uint8)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "name-too-long":
        path = tmp_path / ("d" * 5000)
    elif kind != "missing":
        batch = {"empty": None, "ragged": {b"data": [[1, 2], [3]], b"labels": [0, 1]},
                 "nan-images": {b"data": np.full((2, 3072), np.nan, dtype=np.float32), b"labels": [0, 1]},
                 "negative-label": {b"data": good, b"labels": [0, -1]},
                 "huge-label": {b"data": good, b"labels": np.array([0, 2**63 + 1], dtype=np.uint64)}}[kind]
        path.write_bytes(b"" if batch is None else pickle.dumps(batch))
    with pytest.raises(DataFileError) as err:
        load_cifar_batches([path])
    assert str(path) in str(err.value)


@given(st.sampled_from(["digits", "stdlib-bytes"]),
       st.integers(1, 64) | st.sampled_from([0, -1, True, 10**20, 2.0]),
       st.integers(1, 512) | st.sampled_from([0, True, 10**20]),
       st.integers(1, 4), st.booleans())
@settings(max_examples=25, deadline=None)
def test_builtin_data_with_extreme_sizes_gives_batches_or_one_user_error(dataset, batch_size, seq_len, world_size,
                                                                         heterogeneous):
    try:
        config = DataConfig(dataset=dataset, batch_size=batch_size, seq_len=seq_len, max_bytes=20_000,
                            heterogeneous=heterogeneous)
        batches = build_batches(config, split="train", seed=0, rank=world_size - 1, world_size=world_size)
    except (ConfigError, DataError):
        return
    inputs, targets = next(batches)
    assert len(inputs) == len(targets) == batch_size
    if dataset == "digits":
        assert inputs.shape == (batch_size, 1, 8, 8) and torch.isfinite(inputs).all()
    else:
        assert inputs.shape == (batch_size, seq_len)
