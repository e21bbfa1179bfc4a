"""Only ASCII digits are numbers: ``str.isdigit`` and ``int()`` also take '²', '٣' (Arabic-Indic) and
'３' (fullwidth). Before, a stray directory ``checkpoints/step_²`` blocked every resume with
``invalid literal for int() with base 10: '²'`` (no path named), ``step_٣`` passed for step 3, and
``--workers ٣`` started 3 workers. Such names are ignored, such values refused naming the flag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sdp_train.cli import build_parser
from sdp_train.errors import ConfigError
from sdp_train.parallel.dist import collective_timeout
from sdp_train.trainer.checkpoint import find_checkpoint, latest_valid_checkpoint, save_checkpoint
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.faults import KILL_VARIABLE, InjectedFaults
from sdp_train.trainer.prepare import prepare
from tests.unit.test_checkpoint_integrity import TINY, _run, _train_steps

NOT_ASCII = ["²", "٣", "３", "1٣"]


@pytest.fixture
def two_checkpoints(tmp_path) -> Path:
    """``tmp_path/checkpoints`` with complete checkpoints step_2 and step_4 of a tiny run."""
    run, batches = _run(tmp_path)
    for step in (2, 4):
        _train_steps(run, batches, range(step - 2, step))
        save_checkpoint(run, batches, step, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("name", [f"step_{digits}" for digits in NOT_ASCII])
def test_a_step_directory_named_with_other_digits_is_not_a_checkpoint(two_checkpoints, tmp_path, name):
    (two_checkpoints / name).mkdir()  # a stray directory: no manifest, or a copy of a valid checkpoint
    assert find_checkpoint(two_checkpoints) == two_checkpoints / "step_4"
    assert latest_valid_checkpoint(two_checkpoints) == two_checkpoints / "step_4"
    prep = prepare(TrainConfig(**{**TINY, "steps": 8, "resume": str(tmp_path), "out": str(tmp_path)}))
    assert prep.resume_from == two_checkpoints / "step_4"  # the run directory's newest valid checkpoint


def test_a_copy_of_a_newer_checkpoint_under_another_digit_is_not_taken_for_it(two_checkpoints):
    shutil.copytree(two_checkpoints / "step_4", two_checkpoints / "step_٩")  # '٩' is 9 to int()
    shutil.rmtree(two_checkpoints / "step_4")
    assert find_checkpoint(two_checkpoints) == two_checkpoints / "step_2"


def test_naming_such_a_directory_is_an_error_naming_its_path(two_checkpoints):
    stray = two_checkpoints / "step_²"
    stray.mkdir()
    with pytest.raises(ConfigError) as err:
        find_checkpoint(stray)
    assert str(stray) in str(err.value) and "no complete checkpoint" in str(err.value)


def _numeric_flags() -> list[tuple[str, str]]:
    """(command, flag) for every option of every ``sdp`` command that takes a number."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    found = []
    for command, sub in commands.items():
        for action in sub._actions:
            if not action.option_strings or action.type is None:
                continue
            try:
                number = action.type("7")
            except Exception:
                continue
            if isinstance(number, (int, float)) and number == 7:
                found.append((command, max(action.option_strings, key=len)))
    return found


NUMERIC_FLAGS = _numeric_flags()


def test_the_numeric_flags_are_found():
    assert {("train", "--workers"), ("train", "--weight-decay"), ("design", "--blocks"), ("verify", "--eta"),
            ("plan", "--active"), ("compare", "--seeds"), ("estimate", "--power-iters")} <= set(NUMERIC_FLAGS)


@pytest.mark.parametrize(("command", "flag"), NUMERIC_FLAGS)
def test_every_numeric_flag_refuses_digits_other_than_ascii(capsys, command, flag):
    for value in NOT_ASCII:
        with pytest.raises(SystemExit) as exit_:  # parsed only: an accepted value must not start the command
            build_parser().parse_args([command, flag, value])
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"sdp {command}: error: argument {flag}") and repr(value) in last, last


def test_ascii_numbers_are_still_numbers():
    args = build_parser().parse_args(["train", "--workers", "3", "--lr", "1e-3", "--weight-decay", "0.5"])
    assert (args.workers, args.lr, args.weight_decay) == (3, 1e-3, 0.5)


@pytest.mark.parametrize("value", ["٣:0", "3:١", "²:0"])
def test_a_fault_spec_with_other_digits_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{KILL_VARIABLE}=.* must be STEP:RANK"):
        InjectedFaults.from_environment({KILL_VARIABLE: value}, attempt=0)


def test_a_collective_timeout_with_other_digits_is_refused(monkeypatch):
    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", "٣٠٠")
    with pytest.raises(ValueError, match="SDP_COLLECTIVE_TIMEOUT_S='٣٠٠' must be a positive number of seconds"):
        collective_timeout()
