"""Data streams: determinism, resumption, disjoint shards, heterogeneous splits, loader errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.data import (
    DataConfig,
    TokenBatches,
    build_batches,
    digits_split,
    load_cifar_batches,
    load_token_shard,
    stdlib_corpus,
    stdlib_files,
)
from sdp_train.errors import ConfigError, DataError, DataFileError

SMALL = DataConfig(dataset="stdlib-bytes", batch_size=4, seq_len=32, max_bytes=60_000)
SEGMENTS = [np.arange(n, dtype=np.uint16) + 1000 * i for i, n in enumerate([97, 300, 33, 1, 250, 161])]


def windows_of(batches: TokenBatches) -> set[tuple[int, int]]:
    return set(zip(batches.window_segment.tolist(), batches.window_start.tolist()))


def test_stdlib_batches_are_next_byte_pairs():
    x, y = next(build_batches(SMALL, split="train", seed=0, rank=0, world_size=1))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256


def test_same_seed_same_stream_and_other_seed_differs():
    a, b, c = (build_batches(SMALL, split="train", seed=s, rank=1, world_size=2) for s in (0, 0, 1))
    first_a, first_b, first_c = ([next(s)[0] for _ in range(3)] for s in (a, b, c))
    assert all(torch.equal(p, q) for p, q in zip(first_a, first_b))
    assert not all(torch.equal(p, q) for p, q in zip(first_a, first_c))


def test_resumed_stream_continues_where_it_stopped():
    stream = build_batches(SMALL, split="train", seed=3, rank=0, world_size=2)
    for _ in range(len(stream) + 2):  # cross an epoch boundary
        next(stream)
    state = stream.state_dict()
    resumed = build_batches(SMALL, split="train", seed=3, rank=0, world_size=2)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[0], next(stream)[0])


def test_resuming_with_another_rank_is_rejected():
    state = build_batches(SMALL, split="train", seed=3, rank=0, world_size=2).state_dict()
    with pytest.raises(ConfigError, match="rank=1"):
        build_batches(SMALL, split="train", seed=3, rank=1, world_size=2).load_state_dict(state)


def test_stdlib_train_and_val_files_are_disjoint_and_capped():
    train = stdlib_corpus(split="train", max_bytes=60_000, val_every=3)
    val = stdlib_corpus(split="val", max_bytes=60_000, val_every=3)
    assert sum(map(len, train)) + sum(map(len, val)) == 60_000
    files = stdlib_files()[: len(train) + len(val)]
    expected_val = [f.read_bytes() for i, f in enumerate(files) if (i + 1) % 3 == 0]
    assert len(val) == len(expected_val) > 0
    assert all(expected.startswith(bytes(got)) for got, expected in zip(val, expected_val))


@settings(max_examples=20, deadline=None)
@given(world_size=st.integers(1, 6), heterogeneous=st.booleans())
def test_token_shards_are_disjoint_and_cover_all_windows(world_size, heterogeneous):
    shards = [
        TokenBatches(SEGMENTS, seq_len=16, batch_size=1, seed=0, rank=r, world_size=world_size,
                     heterogeneous=heterogeneous)
        for r in range(world_size)
    ]
    every = TokenBatches(SEGMENTS, seq_len=16, batch_size=1, seed=0, rank=0, world_size=1)
    sets = [windows_of(s) for s in shards]
    assert sum(map(len, sets)) == len(set().union(*sets)) == len(windows_of(every))
    assert set().union(*sets) == windows_of(every)


def test_heterogeneous_token_shards_are_contiguous_file_ranges():
    shards = [TokenBatches(SEGMENTS, seq_len=16, batch_size=1, seed=0, rank=r, world_size=3, heterogeneous=True)
              for r in range(3)]
    for left, right in zip(shards, shards[1:]):
        assert left.window_segment.max() <= right.window_segment.min()
    iid = TokenBatches(SEGMENTS, seq_len=16, batch_size=1, seed=0, rank=0, world_size=3)
    assert len(set(iid.window_segment.tolist())) > len(set(shards[0].window_segment.tolist()))


def test_token_windows_hold_consecutive_tokens_within_a_file():
    stream = TokenBatches(SEGMENTS, seq_len=16, batch_size=5, seed=0, rank=0, world_size=1)
    x, y = stream.batch(0)
    assert torch.equal(y - x, torch.ones_like(x))  # segments are aranges: a window never crosses files


def test_digits_split_shapes_and_normalisation():
    train_x, train_y = digits_split("train")
    val_x, val_y = digits_split("val")
    assert train_x.shape[1:] == (1, 8, 8) and len(train_x) + len(val_x) == 1797 and len(val_x) == 179
    assert abs(float(train_x.mean())) < 1e-5 and abs(float(train_x.std()) - 1) < 1e-3
    assert set(val_y.tolist()) == set(range(10))


@pytest.mark.parametrize(("heterogeneous", "max_classes"), [(True, 4), (False, 10)])
def test_digits_heterogeneous_split_gives_each_rank_few_classes(heterogeneous, max_classes):
    config = DataConfig(dataset="digits", batch_size=8, heterogeneous=heterogeneous)
    seen = []
    for rank in range(5):
        stream = build_batches(config, split="train", seed=0, rank=rank, world_size=5)
        labels = set(stream.labels[torch.from_numpy(stream.sample_index)].tolist())
        seen.append(set(stream.sample_index.tolist()))
        assert len(labels) <= max_classes and (heterogeneous or len(labels) == 10)
    assert sum(map(len, seen)) == len(set().union(*seen)) == 1618


def test_token_bin_shard_round_trip(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(500, dtype="<u2").tofile(path)
    assert load_token_shard(path)[499] == 499
    config = DataConfig(dataset="token-bin", batch_size=2, seq_len=8, train_files=(str(path),), val_files=(str(path),))
    x, y = next(build_batches(config, split="val", seed=0, rank=0, world_size=1))
    assert torch.equal(x[0], torch.arange(8)) and torch.equal(y[0], torch.arange(1, 9))


@pytest.mark.parametrize(
    ("content", "message"), [(b"\x01\x02\x03", "3 bytes"), (b"", "0 bytes"), (None, "does not exist")]
)
def test_bad_token_shard_is_rejected_naming_the_path(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataFileError, match=message) as info:
        load_token_shard(path)
    assert str(path) in str(info.value)


def write_cifar(path, n, *, data_shape=None, dtype=np.uint8):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=data_shape or (n, 3072)).astype(dtype)
    with open(path, "wb") as f:
        pickle.dump({b"data": data, b"labels": list(rng.integers(0, 10, n))}, f)


def test_cifar_batches_load_and_stream(tmp_path):
    write_cifar(tmp_path / "data_batch_1", 12)
    write_cifar(tmp_path / "test_batch", 6)
    images, labels = load_cifar_batches([tmp_path / "data_batch_1"])
    assert images.shape == (12, 3, 32, 32) and labels.shape == (12,)
    config = DataConfig(dataset="cifar", batch_size=3, train_files=(str(tmp_path / "data_batch_1"),),
                        val_files=(str(tmp_path / "test_batch"),))
    x, y = next(build_batches(config, split="val", seed=0, rank=1, world_size=2))
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64


@pytest.mark.parametrize(
    ("kind", "message"),
    [("shape", r"\(n, 3072\)"), ("dtype", "uint8"), ("text", "not a python pickle"), ("missing", "does not exist")],
)
def test_bad_cifar_batch_is_rejected_naming_the_path(tmp_path, kind, message):
    path = tmp_path / "batch"
    if kind == "shape":
        write_cifar(path, 4, data_shape=(4, 100))
    elif kind == "dtype":
        write_cifar(path, 4, dtype=np.float32)
    elif kind == "text":
        path.write_text("not a pickle")
    with pytest.raises(DataFileError, match=message) as info:
        load_cifar_batches([path])
    assert str(path) in str(info.value)


def test_too_few_items_for_a_batch_is_a_data_error():
    with pytest.raises(DataError, match="fewer than batch_size=64"):
        TokenBatches(SEGMENTS, seq_len=16, batch_size=64, seed=0, rank=0, world_size=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": "imagenet"}, "known datasets: stdlib-bytes"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"val_every": 1}, "val_every"),
        ({"dataset": "token-bin"}, "needs train_files"),
    ],
)
def test_invalid_data_config_is_rejected(fields, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**fields)


def test_invalid_rank_is_rejected():
    with pytest.raises(ConfigError, match="rank=2, world_size=2"):
        build_batches(SMALL, split="train", seed=0, rank=2, world_size=2)
