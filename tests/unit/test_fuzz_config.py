"""Fuzzed training configs end in a valid `TrainConfig` or one `ConfigError`, never another exception.

Config files get arbitrary JSON (NaN/Infinity tokens, huge integers, nested junk, unknown keys),
truncated and garbled text, binary bytes and paths that are missing, directories or FIFOs; every
field gets values of the wrong type; ``model_overrides`` get junk and sizes that would need
terabytes, which must be refused before anything is allocated.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab.errors import DesignError, MaskError
from sdp_train.errors import ConfigError
from sdp_train.models import get_model_config, model_names, num_params
from sdp_train.parallel.blockmap import MAX_LAYERS, MAX_PARAMS
from sdp_train.trainer.config import MODES, TrainConfig, load_config_file
from sdp_train.trainer.prepare import prepare

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

huge_ints = st.integers(-(10**40), 10**40)
beyond_float_ints = st.sampled_from([10**400, -(10**400), 2**1024])  # JSON integers no float can hold
odd_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324])
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | huge_ints | st.floats() | odd_floats | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
CHOICES = {"mode": MODES, "model": model_names(), "data": ("auto", "stdlib", "digits", "bin:/nonexistent", "zzz"),
           "construction": ("auto", "cyclic", "random", "nope"), "nonfinite": ("stop", "skip")}


def _field_values(name: str, type_name: str) -> st.SearchStrategy:
    """Values of the field's type (valid and out of range) mixed with junk of any type."""
    typed = {
        "int": st.integers(-2, 9) | huge_ints,
        "float": st.floats(-2, 2) | odd_floats | st.integers(-2, 2) | beyond_float_ints,
        "bool": st.booleans(),
    }.get(type_name.split(" |")[0])
    if name in CHOICES:
        typed = st.sampled_from(CHOICES[name]) | st.text(max_size=8)
    elif name == "model_overrides":
        typed = st.dictionaries(st.sampled_from(["dim", "n_layers", "width_multiplier", "bogus"]), junk, max_size=2)
    elif typed is None:
        typed = st.text(max_size=12) | st.none()
    return typed | typed | junk  # the field's own type twice as often as junk


FIELD_VALUES = {f.name: _field_values(f.name, str(f.type)) for f in fields(TrainConfig)}
config_dicts = st.lists(st.sampled_from(sorted(FIELD_VALUES)) | st.sampled_from(["stepz", "", "lr "]), max_size=5,
                        unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELD_VALUES.get(k, junk) for k in keys}))


def _check_config_or_error(data: dict) -> TrainConfig | None:
    """The property: a valid config whose numbers are in range, or a ConfigError naming a given key."""
    try:
        cfg = TrainConfig.from_dict(data, source="fuzz")
    except ConfigError as exc:
        assert any(key in str(exc) or repr(key) in str(exc) for key in data), (data, str(exc))
        return None
    assert cfg.mode in MODES and cfg.workers >= 1 and cfg.steps >= 1 and cfg.seed >= 0
    assert cfg.active is None or (not isinstance(cfg.active, bool) and 0 < cfg.active <= 1)
    assert all(math.isfinite(getattr(cfg, n)) for n in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"))
    assert isinstance(cfg.max_data_bytes, int) and not isinstance(cfg.max_data_bytes, bool)
    return cfg


@given(config_dicts)
@FUZZ
def test_any_field_values_give_a_valid_config_or_a_config_error_naming_the_field(data):
    _check_config_or_error(data)


@given(config_dicts | junk)
@FUZZ
def test_any_json_config_file_gives_a_valid_config_or_a_config_error(tmp_path, data):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))  # allow_nan: NaN and Infinity tokens reach the loader
    try:
        values = load_config_file(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
        assert not isinstance(data, dict) or "NaN" in path.read_text() or "Infinity" in path.read_text()
        return
    assert isinstance(values, dict)
    _check_config_or_error(values)


VALID = json.dumps({"model": "llama-debug", "mode": "nsdp", "active": 0.5, "workers": 4, "steps": 10, "lr": 0.01,
                    "model_overrides": {"n_layers": 2}, "data": "stdlib", "out": "runs/x"}, indent=1)


@given(st.integers(0, len(VALID)), st.integers(0, 8), st.binary(max_size=8))
@FUZZ
def test_truncated_or_garbled_config_files_give_a_config_error_naming_the_file(tmp_path, cut, width, noise):
    path = tmp_path / "c.json"
    path.write_bytes(VALID.encode()[:cut] + noise + VALID.encode()[cut + width:])
    try:
        values = load_config_file(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
        return
    _check_config_or_error(values)


@given(st.binary(max_size=200))
@FUZZ
def test_arbitrary_bytes_as_a_config_file_give_a_config_error(tmp_path, data):
    path = tmp_path / "c.json"
    path.write_bytes(data)
    try:
        values = load_config_file(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
    else:
        assert isinstance(values, dict)


@pytest.mark.parametrize("field", ["weight_decay", "lr", "grad_clip", "min_lr_ratio"])
def test_a_401_digit_integer_in_a_float_field_of_a_config_file_is_one_error_line(tmp_path, capsys, field):
    from sdp_train.cli import main

    path = tmp_path / "c.json"
    path.write_text('{"%s": 1%s}' % (field, "0" * 400))  # JSON allows it; no float can hold it
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"sdp train: error: {field}=1000") and "finite number" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["missing", "directory", "under-a-file", "fifo", "name-too-long", "empty",
                                  "deep-nesting", "huge-integer", "nan", "infinity", "latin-1", "list"])
def test_bad_config_paths_and_contents_give_a_config_error_naming_the_file(tmp_path, kind):
    path = tmp_path / "c.json"
    if kind == "missing":
        path = tmp_path / "nope.json"
    elif kind == "directory":
        path.mkdir()
    elif kind == "under-a-file":
        path.write_text("{}")
        path = path / "x.json"
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    elif kind == "name-too-long":
        path = tmp_path / ("a" * 5000)
    else:
        path.write_bytes({"empty": b"", "deep-nesting": b"[" * 100_000 + b"]" * 100_000,
                          "huge-integer": b'{"seed": ' + b"9" * 5000 + b"}", "nan": b'{"lr": NaN}',
                          "infinity": b'{"model_overrides": {"rope_theta": -Infinity}}',
                          "latin-1": '{"out": "caf\xe9"}'.encode("latin-1"), "list": b"[1, 2]"}[kind])
    with pytest.raises(ConfigError) as err:
        load_config_file(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("active", True, "active=True must be in (0, 1]"),
    ("max_data_bytes", "abc", "max_data_bytes='abc' must be an integer >= 1"),
    ("max_data_bytes", math.nan, "max_data_bytes=nan must be an integer >= 1"),
    ("workers", 10**30, "exceeds the supported maximum"),
    ("seed", 2**64, "seed=18446744073709551616 must be < 2**63"),
    ("model_overrides", {1: 2}, "model_overrides must be a mapping of config fields"),
    pytest.param("weight_decay", 10**400, f"weight_decay={10**400} must be a finite number >= 0", id="401 digits"),
    pytest.param("lr", -(10**400), "must be a finite number >= 0", id="-401 digits"),
    pytest.param("grad_clip", 2**1024, f"grad_clip={2**1024} must be", id="2**1024"),
])
def test_values_that_used_to_pass_or_crash_are_config_errors(field, value, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({field: value})
    assert message in str(err.value)


def _override_values(model: str) -> st.SearchStrategy:
    base = get_model_config(model)
    names = [f.name for f in fields(base)] + ["bogus"]
    value = st.integers(-2, 64) | huge_ints | st.floats(allow_nan=True) | odd_floats | st.lists(
        st.integers(-1, 3) | huge_ints | st.floats(), max_size=5) | junk
    return st.dictionaries(st.sampled_from(names), value, max_size=3)


@given(st.sampled_from(model_names()).flatmap(lambda m: st.tuples(st.just(m), _override_values(m))))
@FUZZ
def test_model_overrides_give_a_small_enough_model_or_a_config_error(model_and_overrides):
    model, overrides = model_and_overrides
    try:
        config = get_model_config(model, **overrides)
    except ConfigError as exc:
        assert model in str(exc) or any(str(k) in str(exc) for k in overrides), str(exc)
        return
    assert num_params(config) <= MAX_PARAMS
    assert getattr(config, "n_layers", 0) <= MAX_LAYERS


@pytest.mark.parametrize(("model", "overrides", "message"), [
    ("llama-debug", {"dim": 10**12, "n_heads": 2}, "parameters exceed the supported maximum"),
    ("llama-debug", {"n_layers": 10**4}, "residual blocks exceed the supported maximum"),
    ("llama-debug", {"hidden_dim": 2**20, "neuron_groups": 2**20}, "neuron blocks"),
    ("llama-debug", {"rope_theta": math.nan}, "rope_theta must be a finite number > 0, got nan"),
    ("llama-debug", {"norm_eps": "1e-5"}, "norm_eps must be a finite number > 0"),
    ("llama-debug", {"rope_theta": 10**400}, "rope_theta must be a finite number > 0, got 1000"),
    ("llama-debug", {"dim": True}, "dim must be a positive int, got True"),
    ("llama-debug", {"name": 7}, "unknown config fields ['name']"),
    ("resnet18-cifar", {"width_multiplier": 1e6}, "parameters exceed the supported maximum"),
    ("resnet18-cifar", {"width_multiplier": math.inf}, "width_multiplier must be a finite number > 0"),
    ("resnet18-cifar", {"blocks_per_stage": 5}, "blocks_per_stage must be a list of ints"),
    ("resnet18-cifar", {"blocks_per_stage": [1.5, 2]}, "positive int entries"),
    ("resnet18-cifar", {"blocks_per_stage": [10**9]}, "residual blocks exceed the supported maximum"),
    ("vit-tiny", {"dim": 10**8, "n_heads": 1}, "parameters exceed the supported maximum"),
    ("vit-tiny", {"patch_size": 2.0}, "patch_size must be a positive int"),
    ("swin-debug", {"depths": [10**9, 1]}, "residual blocks exceed the supported maximum"),
    ("swin-debug", {"heads": "2"}, "heads must be a non-empty list of positive ints, got '2'"),
    ("swin-debug", {"dim": 10**6, "heads": [1, 1]}, "parameters exceed the supported maximum"),
])
def test_prepare_refuses_junk_and_huge_model_overrides_before_allocating(model, overrides, message):
    cfg = TrainConfig(model=model, model_overrides=overrides, workers=2)
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert message in str(err.value)


small_overrides = st.fixed_dictionaries({}, optional={
    "n_layers": st.integers(-1, 5), "dim": st.sampled_from([0, 8, 16, 30, 10**13]), "n_heads": st.integers(0, 4),
    "hidden_dim": st.sampled_from([8, 16, 12]), "neuron_groups": st.integers(0, 5), "vocab_size": st.integers(0, 300),
    "max_seq_len": st.integers(0, 100)})


@given(small_overrides, st.sampled_from(MODES), st.integers(1, 5), st.sampled_from([0.3, 0.5, 1.0]),
       st.integers(1, 130))
@settings(max_examples=50, deadline=None)
def test_prepare_gives_a_plan_or_one_user_error(overrides, mode, workers, active, seq_len):
    try:  # a C that the workers cannot realise (0.3 of 2) is refused by the config itself
        prep = prepare(TrainConfig(model="llama-debug", model_overrides=overrides, mode=mode, workers=workers,
                                   active=active, seq_len=seq_len))
    except (ConfigError, MaskError, DesignError):
        return
    assert prep.model_config.n_layers == overrides.get("n_layers", 4)
    assert seq_len <= prep.model_config.max_seq_len
    assert prep.mask is None or prep.mask.workers == workers
