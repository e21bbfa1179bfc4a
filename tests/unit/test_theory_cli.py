"""`sdp verify` (theory.cli) through its own argparse parser."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from masklab.io import load_mask, save_mask
from masklab.mask import Mask, Schedule
from sdp_train.cli import main
from theory import cli

BASE = ["--smoothness", "1", "--sigma", "1", "--zeta", "1", "--eta", "0.5", "--steps", "100",
        "--suboptimality", "1"]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["verify", *argv])
    return args.func(args)


@pytest.fixture
def mask_file(tmp_path):
    m = np.zeros((8, 4), dtype=np.uint8)
    for j in range(4):
        m[[(2 * j + t) % 8 for t in range(4)], j] = 1
    return str(save_mask(Mask(m, block_sizes=[8] * 4, schedule=Schedule("permute", 1)), tmp_path / "m.json"))


def test_verify_json_reports_every_key(mask_file, capsys):
    assert _run([mask_file, *BASE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"step_size_ok", "eta_max", "terms", "bound", "ddp_bound", "ratio_to_ddp"} <= set(out)
    assert set(out["terms"]) == {"optimization", "bias", "variance", "consensus"}
    assert out["step_size_ok"] and out["eta_max"] == 1.0 and out["terms"]["bias"] == 0.0
    # variance: L eta (sum_j sigma_j^2/4 + kappa zeta^2), kappa = (K - c)/(c (K - 1)) = 1/7 (Theorem 2')
    assert out["terms"]["variance"] == pytest.approx(0.5 * (0.25 + 1 / 7))
    assert out["ratio_to_ddp"] == pytest.approx(out["bound"] / out["ddp_bound"])


def test_verify_simulate_quadratic_holds(mask_file, capsys):
    assert _run([mask_file, *BASE, "--simulate", "quadratic", "--seeds", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["violated"] is False and out["assumptions_held"] and 0 < out["measured"] < out["bound"]


def test_verify_text_reports_failed_step_size(mask_file, capsys):
    argv = [mask_file, *BASE]
    argv[argv.index("--eta") + 1] = "2"
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "VIOLATES 0 < eta <= 1" in out and "not a proved bound" in out


@pytest.fixture
def every_2_file(mask_file, tmp_path):
    """The mask of `mask_file`, redrawn every 2 steps: one mask per round of H = 2 local steps."""
    mask = load_mask(mask_file)
    return str(save_mask(mask.replace(schedule=Schedule("permute", 2)), tmp_path / "every2.json"))


def test_verify_local_steps_need_grad_bound(every_2_file):
    with pytest.raises(ValueError, match="--grad-bound"):
        _run([every_2_file, *BASE, "--local-steps", "2"])


def test_verify_local_steps_with_grad_bound(every_2_file, capsys):
    argv = [every_2_file, *BASE, "--local-steps", "2", "--grad-bound", "3", "--json"]
    argv[argv.index("--eta") + 1] = "0.2"
    argv[argv.index("--steps") + 1] = "50"
    assert _run(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["terms"]["consensus"] > 0 and out["eta_max"] == 0.25
    assert out["theorem"].startswith("Theorem 3")


@pytest.mark.parametrize("extra", [[], ["--overlap"], ["--simulate", "quadratic"]])
def test_verify_refuses_local_steps_a_schedule_changes_the_mask_within(mask_file, capsys, extra):
    """A permute mask redrawn every step under H = 2 local steps: a round would train under two masks,
    which the runtime refuses (`sdp train`, `SubnetworkDataParallel`, `OverlapAveraging`), so no
    theorem bounds it; refused like any other input error, naming both values."""
    argv = ["verify", mask_file, *BASE, "--local-steps", "2", "--grad-bound", "3", *extra]
    argv[argv.index("--eta") + 1] = "0.2"
    argv[argv.index("--steps") + 1] = "50"
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdp verify: error: "), captured.err
    assert "every=1 must be a multiple of local_steps=2" in lines[0]


@pytest.mark.parametrize(("kind", "deviation"), [("permute", "Theorem 6 (overlap averaging; consensus deviation by "
                                                              "Theorems 4.8 and 4.4)"),
                                                  ("cyclic", "Theorem 6 or 6.3, the smaller (overlap averaging; "
                                                             "consensus deviation by Theorems 4.7 and 4.6)")])
def test_verify_overlap_names_the_deviation_theorem(mask_file, tmp_path, capsys, kind, deviation):
    """--overlap prints Theorem 6 with the consensus-deviation theorems it used: 4.7/4.6 for a deterministic schedule,
    and Theorem 6.3 beside 6 for a mask held over rounds."""
    path = str(save_mask(load_mask(mask_file).replace(schedule=Schedule(kind, 2)), tmp_path / f"{kind}.json"))
    argv = [path, *BASE, "--local-steps", "2", "--grad-bound", "3", "--overlap", "--json"]
    argv[argv.index("--eta") + 1] = "0.05"
    argv[argv.index("--steps") + 1] = "50"
    assert _run(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["theorem"] == deviation
    assert math.isfinite(out["bound"])
    if kind == "cyclic":  # a mask held over rounds: Theorem 6.2 at period starts too
        assert out["period_bound"]["theorem"].startswith("Theorem 6.2") and out["period_bound"]["bound"] > 0
    else:  # redrawn every round: Theorem 6 has no bias term to remove
        assert "period_bound" not in out
