"""`sdp`'s parser imports only the command it runs; every command is still listed by ``sdp --help``."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from sdp_train.cli import COMMAND_MODULES, SUBCOMMAND_MODULES, build_parser
from tests.child_env import child_env


def _commands(parser) -> dict:
    return next(a for a in parser._actions if a.dest == "command").choices


def test_every_module_registers_exactly_the_commands_mapped_to_it():
    for module in SUBCOMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert set(sub.choices) == {c for c, m in COMMAND_MODULES.items() if m == module}, module
    assert list(_commands(build_parser([]))) == list(COMMAND_MODULES)  # --help's order


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_a_named_command_gets_the_same_parser_as_the_full_one(command):
    alone = _commands(build_parser([command, "--help"]))[command]
    full = _commands(build_parser([]))[command]
    assert alone.format_help() == full.format_help()


def test_help_lists_every_command_and_a_typo_still_names_them_all(capsys):
    for argv in (["--help"], ["trian"]):
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args(argv)
        out = capsys.readouterr()
        assert all(c in out.out + out.err for c in COMMAND_MODULES), argv


def test_sdp_train_parsing_loads_neither_theory_nor_scipy_optimize():
    code = ("import sys; from sdp_train.cli import build_parser; "
            "build_parser(['train', '--workers', '2']).parse_args(['train', '--workers', '2']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'theory' or m.startswith('scipy.optimize')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    assert out.stdout.strip() == "[]", out.stdout
