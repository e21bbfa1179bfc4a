"""Fuzzed user input ends in one clear error of the project's own types, never a library traceback.

Mask files, `sdp design` / `sdp inspect` arguments and token shards get arbitrary bytes, arbitrary
JSON, mutated valid files, NaN/inf and huge or negative sizes.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab.errors import MaskFileError
from masklab.io import load_mask, mask_to_dict
from masklab.mask import Mask
from sdp_train.cli import main
from sdp_train.data import load_token_shard
from sdp_train.errors import DataFileError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@given(st.binary(max_size=300))
@FUZZ
def test_arbitrary_bytes_as_a_mask_file_give_mask_file_error(tmp_path, data):
    path = tmp_path / "m.json"
    path.write_bytes(data)
    with pytest.raises(MaskFileError):
        load_mask(path)


@given(json_values)
@FUZZ
def test_arbitrary_json_as_a_mask_file_gives_mask_file_error(tmp_path, value):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(value))
    with pytest.raises(MaskFileError):
        load_mask(path)


@given(st.sampled_from(sorted(mask_to_dict(Mask([[1, 0], [1, 1]])))), json_values | st.just(float("nan")))
@FUZZ
def test_a_valid_mask_file_with_one_field_replaced_loads_or_fails_cleanly(tmp_path, key, value):
    data = mask_to_dict(Mask([[1, 0], [1, 1]]))
    data[key] = value
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    try:
        load_mask(path)
    except MaskFileError as exc:
        assert str(path) in str(exc)


numbers = st.sampled_from(["0", "-1", "1", "2", "3", "7", "9", "nan", "inf", "-inf", "1e400", "0.5", "abc", ""])


@given(st.lists(st.sampled_from(["--workers", "--blocks", "--active", "--coverage", "--every", "--seed",
                                 "--construction", "--schedule"]) | numbers, max_size=10))
@settings(max_examples=100, deadline=None)
def test_fuzzed_design_arguments_exit_cleanly(argv):
    try:
        code = main(["design", *argv])
    except SystemExit as exc:  # argparse: usage line + one error line, exit 2
        assert exc.code == 2
        return
    assert code in (0, 2)


@given(st.integers(-3, 12), st.integers(-3, 12), st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                                           st.integers(-5, 20)))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_design_sizes_exit_zero_or_with_one_error_line(capsys, k, b, budget):
    flag = "--active" if isinstance(budget, float) else "--coverage"
    capsys.readouterr()  # each example reads only its own output
    code = main(["design", f"-K={k}", f"-B={b}", f"{flag}={budget}", "--json"])
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["workers"] == k
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("sdp design: error:")


@given(st.binary(max_size=64))
@FUZZ
def test_token_shards_load_or_fail_with_data_file_error(tmp_path, data):
    path = tmp_path / "s.bin"
    path.write_bytes(data)
    try:
        tokens = load_token_shard(path)
    except DataFileError as exc:
        assert str(path) in str(exc)
    else:
        assert len(tokens) * 2 == len(data)


def test_directories_and_missing_paths_are_refused_by_every_loader(tmp_path):
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(MaskFileError):
            load_mask(path)
        with pytest.raises(DataFileError):
            load_token_shard(path)


def test_mask_paths_that_block_or_overflow_the_parser_give_mask_file_error(tmp_path):
    fifo, deep, long_name = tmp_path / "fifo.json", tmp_path / "deep.json", tmp_path / ("m" * 5000)
    os.mkfifo(fifo)  # reading it would block forever
    deep.write_text("[" * 100_000 + "]" * 100_000)  # json recursion limit
    for path in (fifo, deep, long_name):
        with pytest.raises(MaskFileError) as err:
            load_mask(path)
        assert str(path) in str(err.value)
