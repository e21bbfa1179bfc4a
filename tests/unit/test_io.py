"""Mask and costs files: exact round trip; every malformed file gives one clear MaskFileError
(CostsFileError) naming the file."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab.costs import BlockCosts
from masklab.errors import CostsFileError, MaskFileError
from masklab.io import load_costs, load_mask, mask_from_dict, mask_to_dict, save_costs, save_mask
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


# -- costs files -------------------------------------------------------------------------------
@given(st.lists(st.integers(1, 2**40), min_size=1, max_size=12), st.booleans(), st.integers(0, 2**40),
       st.none() | st.text(max_size=20))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_costs_file_round_trip_is_exact(tmp_path, block_bytes, named, fixed, source):
    names = [f"layers.{j}" for j in range(len(block_bytes))] if named else None
    costs = BlockCosts(block_bytes, block_names=names, fixed_bytes=fixed, source=source)
    assert load_costs(save_costs(costs, tmp_path / "costs.json")) == costs


def test_costs_file_header_is_versioned_and_fields_default(tmp_path):
    path = save_costs(BlockCosts([4, 8]), tmp_path / "c.json")
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["block_bytes"]) == ("sdp-costs", 1, [4, 8])
    path.write_text(json.dumps({"format": "sdp-costs", "version": 1, "block_bytes": [3]}))
    assert load_costs(path) == BlockCosts([3], fixed_bytes=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "sdp-mask", "version": 1, "block_bytes": [1]}, "not an SDP costs file"),
        ({"format": "sdp-costs", "version": 2, "block_bytes": [1]}, "unknown costs file version 2"),
        ({"format": "sdp-costs", "version": 1}, "missing field 'block_bytes'"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1], "bytes": 3}, "unknown field(s) ['bytes']"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": "12"}, "field 'block_bytes' must be a list"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1, 0]}, "block_bytes[1] = 0"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1, 2.0]}, "block_bytes[1] = 2.0"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1], "fixed_bytes": -3}, "fixed_bytes = -3"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1, 2], "block_names": ["a"]},
         "'block_names' has 1 entries but 'block_bytes' has 2"),
        ({"format": "sdp-costs", "version": 1, "block_bytes": [1, 2], "block_names": ["a", "a"]}, "'a'"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_costs_files_are_rejected_naming_file_and_field(tmp_path, data, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostsFileError) as exc:
        load_costs(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value)


@pytest.mark.parametrize(("content", "message"), [("", "file is empty"), ('{"format": "sdp-costs", ', "truncated"),
                                                  ('{"block_bytes": [NaN]}', "non-finite number NaN"),
                                                  (None, "no such costs file")])
def test_unreadable_costs_files_are_rejected_cleanly(tmp_path, content, message):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CostsFileError, match=message):
        load_costs(path)
