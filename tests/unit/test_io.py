"""Mask files: exact round trip; every malformed file gives one clear MaskFileError naming the file."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab.errors import MaskFileError
from masklab.io import load_mask, mask_from_dict, mask_to_dict, save_mask
from masklab.mask import Mask, Schedule
from tests.strategies import masks


@given(masks(schedule=True), st.booleans(), st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_json_round_trip_is_exact(tmp_path, mask, named, sized):
    if named:
        mask = mask.replace(block_names=[f"layers.{j}" for j in range(mask.blocks)])
    if sized:
        mask = mask.replace(block_sizes=[j + 1 for j in range(mask.blocks)], construction="test")
    path = save_mask(mask, tmp_path / "m.json")
    loaded = load_mask(path)
    assert loaded == mask
    assert loaded.schedule == mask.schedule


def test_file_header_is_versioned(tmp_path):
    data = json.loads(save_mask(Mask([[1, 0], [0, 1]]), tmp_path / "m.json").read_text())
    assert data["format"] == "sdp-mask" and data["version"] == 1
    assert data["rows"] == ["10", "01"]


def _write(tmp_path, text: str):
    p = tmp_path / "m.json"
    p.write_text(text)
    return p


def _good() -> dict:
    return mask_to_dict(Mask([[1, 1, 0], [0, 1, 1]], schedule=Schedule("cyclic", 2)))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="other"), "not an SDP mask file: format is 'other'"),
        (lambda d: d.pop("format"), "format is None"),
        (lambda d: d.update(version=2), "unknown mask file version 2"),
        (lambda d: d.update(version=True), "unknown mask file version True"),
        (lambda d: d.pop("rows"), "missing field(s) ['rows']"),
        (lambda d: d.update(colour="red"), "unknown field(s) ['colour']"),
        (lambda d: d.update(workers="2"), "field 'workers' must be an integer"),
        (lambda d: d.update(blocks=0), "field 'blocks' must be >= 1"),
        (lambda d: d.update(rows=["110"]), "field 'rows' has 1 rows but 'workers' is 2"),
        (lambda d: d.update(rows=["110", "01"]), "row 1 has 2 entries but 'blocks' is 3"),
        (lambda d: d.update(rows=["110", "0x1"]), "row 1, column 1 is 'x'"),
        (lambda d: d.update(rows=["110", 11]), "row 1 must be a string"),
        (lambda d: d.update(rows="110"), "field 'rows' must be a list"),
        (lambda d: d.update(rows=["100", "001"]), "block 1 (column 1, 'block1') is held by no worker"),
        (lambda d: d.update(schedule={"kind": "weekly"}), "field 'schedule': schedule kind 'weekly'"),
        (lambda d: d.update(schedule={"kind": "cyclic", "every": 0}), "every=0 must be >= 1"),
        (lambda d: d.update(schedule={"kind": "cyclic", "when": 0}), "unknown key(s) ['when']"),
        (lambda d: d.update(schedule="cyclic"), "field 'schedule' must be an object"),
        (lambda d: d.update(block_names=["a", "a", "b"]), "used by columns 0 and 1"),
        (lambda d: d.update(block_names="abc"), "field 'block_names' must be a list"),
        (lambda d: d.update(block_sizes=[1, -1, 1]), "block size for column 1"),
        (lambda d: d.update(construction=3), "field 'construction' must be a string"),
    ],
)
def test_malformed_fields_are_rejected_naming_file_and_field(tmp_path, mutate, message):
    data = _good()
    mutate(data)
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(MaskFileError) as err:
        load_mask(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_non_object_top_level_is_rejected():
    with pytest.raises(MaskFileError, match="expected a JSON object at the top level, got list"):
        mask_from_dict([1, 2])


@given(st.integers(1, 200))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_truncation_of_a_valid_file_is_rejected_cleanly(tmp_path, cut):
    text = json.dumps(_good(), indent=1)
    cut = min(cut, len(text) - 1)
    path = _write(tmp_path, text[:cut])
    with pytest.raises(MaskFileError) as err:
        load_mask(path)
    assert str(path) in str(err.value)


def test_truncated_file_says_it_looks_truncated(tmp_path):
    text = json.dumps(_good())
    with pytest.raises(MaskFileError, match="looks truncated"):
        load_mask(_write(tmp_path, text[: len(text) // 2]))


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "file is empty"), ("   \n", "file is empty"), ('{"format": NaN}', "non-finite number NaN"),
     ("[1, 2", "invalid JSON at line 1")],
)
def test_empty_invalid_and_non_finite_files_are_rejected(tmp_path, content, message):
    with pytest.raises(MaskFileError, match=message):
        load_mask(_write(tmp_path, content))


def test_binary_missing_and_directory_paths_are_rejected(tmp_path):
    binary = tmp_path / "m.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(MaskFileError, match="not a text"):
        load_mask(binary)
    with pytest.raises(MaskFileError, match="no such mask file"):
        load_mask(tmp_path / "missing.json")
    with pytest.raises(MaskFileError, match="is a directory"):
        load_mask(tmp_path)


def test_save_refuses_directories_and_missing_parents_and_keeps_old_file(tmp_path):
    mask = Mask([[1]])
    with pytest.raises(MaskFileError, match="is a directory"):
        save_mask(mask, tmp_path)
    with pytest.raises(MaskFileError, match="does not exist"):
        save_mask(mask, tmp_path / "nope" / "m.json")
    path = save_mask(Mask([[1, 1]]), tmp_path / "m.json")
    before = path.read_bytes()
    with pytest.raises(TypeError):
        save_mask("not a mask", path)  # type: ignore[arg-type]
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.json"]  # no temporary file left behind
