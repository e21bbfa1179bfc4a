"""`sdp design` / `sdp inspect`: the JSON output contract, files written, and bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from masklab.costs import BlockCosts
from masklab.io import load_mask, save_costs
from sdp_train.cli import main
from tests.child_env import child_env

REPORT_KEYS = {
    "workers", "blocks", "active_fraction", "coverage_min", "coverage_max", "masking_error",
    "variance_inflation", "spectral_gap", "spectral_gap_bound", "optimality_ratio",
    "cotraining_gap", "connected", "construction",
}


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_design_json_report_has_the_contract_keys_and_an_exact_plane(capsys):
    report = _run_json(capsys, ["design", "--workers", "7", "--blocks", "7", "--coverage", "3", "--json"])
    assert REPORT_KEYS <= set(report)
    assert report["construction"] == "projective-plane"
    assert report["optimality_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert report["coverage_min"] == report["coverage_max"] == 3


def test_design_out_then_inspect_gives_the_same_certificate(tmp_path, capsys):
    out = tmp_path / "mask.json"
    designed = _run_json(capsys, ["design", "-K", "8", "-B", "16", "--active", "0.5", "--seed", "3",
                                  "--schedule", "cyclic", "--every", "4", "--out", str(out), "--json"])
    inspected = _run_json(capsys, ["inspect", str(out), "--json"])
    assert designed == inspected
    # a cyclic rotation is correlated with the iterate: the theory uses the mask in force, c = 4 of 8
    assert inspected["masking_error"] == pytest.approx(1.0)
    assert inspected["masking_error_regime"].startswith("mask in force")
    assert "spectral_gap" in inspected["used_by"] and "overlap averaging only" in inspected["used_by"]["spectral_gap"]
    assert load_mask(out).schedule.every == 4


def test_design_tolerate_survives_f_losses_and_inspect_reports_the_fatal_sets(tmp_path, capsys):
    out = tmp_path / "mask.json"
    designed = _run_json(capsys, ["design", "-K", "8", "-B", "8", "--tolerate", "2", "--out", str(out), "--json"])
    assert designed["coverage_min"] == 3 and designed["failures_survived"] == 2
    assert designed["fatal_sets_total"] == len(designed["fatal_sets"]) == 8  # 8 distinct holder sets of 3
    assert _run_json(capsys, ["inspect", str(out), "--json"]) == designed
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "failures survived" in text and "(8 sets of 3 workers)" in text


def test_design_costs_tolerate_sets_the_min_coverage_or_refuses_a_lower_one(capsys, costs_file):
    report = _run_json(capsys, ["design", "--costs", str(costs_file), "-K", "6", "--tolerate", "2", "--json"])
    assert report["failures_survived"] >= 2
    assert main(["design", "--costs", str(costs_file), "-K", "6", "--tolerate", "2", "--min-coverage", "2"]) == 2
    assert "--tolerate 2 needs every block on at least 3 workers, but --min-coverage is 2" in capsys.readouterr().err


def test_design_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "mask.png"
    assert main(["design", "-K", "6", "-B", "9", "--coverage", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "spectral gap (gamma)" in text and "optimality ratio" in text
    gap_line = next(line for line in text.splitlines() if line.startswith("spectral gap (gamma)"))
    assert "no stepwise theorem" in gap_line  # every number says which theorem uses it
    assert "diagnostic, used by no theorem" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["design", "-K", "4", "-B", "4", "--active", "0"], "--active 0.0 must be in (0, 1]"),
        (["design", "-K", "4", "-B", "4", "--active", "1.5"], "--active 1.5 must be in (0, 1]"),
        (["design", "-K", "0", "-B", "4", "--active", "0.5"], "0"),
        (["design", "-K", "4", "-B", "4", "--coverage", "5"], "5"),
        (["design", "-K", "4", "-B", "4", "--coverage", "2", "--construction", "magic"], "magic"),
        (["design", "-K", "4", "-B", "4", "--coverage", "2", "--every", "0"], "every=0"),
        (["design", "-K", "4", "-B", "4", "--coverage", "2", "--plot", "x.jpg"], ".png"),
        (["inspect", "/nonexistent/mask.json"], "no such mask file"),
        (["design", "-K", "8", "-B", "8", "--active", "0.25", "--tolerate", "2"],
         "tolerate=2 needs every block on at least 3 workers, but active=0.25 gives coverage 2 of K=8"),
        (["design", "-K", "4", "-B", "4", "--tolerate", "4"], "tolerate=4 is impossible with K=4 workers"),
    ],
)
def test_bad_arguments_exit_non_zero_with_one_clear_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sdp {argv[0]}: error:")
    assert message in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing written by a failing run


def test_failing_design_does_not_touch_an_existing_out_file(tmp_path, capsys):
    out = tmp_path / "mask.json"
    out.write_text("precious")
    assert main(["design", "-K", "4", "-B", "4", "--coverage", "9", "--out", str(out)]) == 2
    assert out.read_text() == "precious"


def test_argparse_errors_exit_non_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["design", "-K", "four", "-B", "4", "--active", "0.5"])
    assert exc.value.code != 0


def test_console_script_runs_as_a_real_process(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "design", "-K", "9", "-B", "12", "--coverage", "3",
         "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["construction"] == "affine-plane"
    bad = subprocess.run([sys.executable, "-m", "sdp_train.cli", "inspect", str(tmp_path)], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is a directory" in bad.stderr


# -- sdp design --costs ------------------------------------------------------------------------
STAGES = [10**9, 10**9, 2 * 10**9, 2 * 10**9, 4 * 10**9, 4 * 10**9, 8 * 10**9, 8 * 10**9]


@pytest.fixture
def costs_file(tmp_path):
    names = [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]
    return save_costs(BlockCosts(STAGES, block_names=names, fixed_bytes=3 * 10**9), tmp_path / "costs.json")


def test_design_costs_with_budgets_fits_every_worker_and_reports_its_bytes(capsys, costs_file):
    report = _run_json(capsys, ["design", "--costs", str(costs_file), "--budgets", "80GB,80GB,8GB,8GB", "--json"])
    assert REPORT_KEYS <= set(report) and report["construction"] == "byte-balance"
    assert report["workers"] == 4 and report["coverage_min"] == report["coverage_max"] == 2
    assert report["budgets"] == [80 * 10**9, 80 * 10**9, 8 * 10**9, 8 * 10**9]
    assert all(b <= cap for b, cap in zip(report["worker_bytes"], report["budgets"]))
    assert report["largest_worker_bytes"] == max(report["worker_bytes"]) >= report["bytes_lower_bound"]


def test_design_costs_text_lists_each_worker_against_its_budget_and_out_keeps_names(capsys, costs_file, tmp_path):
    out = tmp_path / "mask.json"
    assert main(["design", "--costs", str(costs_file), "-K", "4", "--budgets", "24GB,24GB,24GB,24GB",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "largest 18 GB; no mask with coverage 2 puts less than 18 GB on its largest worker" in text
    assert text.count("budget      24 GB  (75% used)") == 4
    mask = load_mask(out)
    assert mask.block_names[0] == "layer1.0" and mask.construction == "byte-balance"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budgets", "80GB,80GB,2GB"], "worker 2 holds at least 4000000000 bytes (3000000000 fixed + 1000000000"),
        (["--budgets", "20GB,20GB,20GB"], "no mask fits: coverage 2 needs 60000000000 bytes"),
        (["--budgets", "80GB,8XB"], "budget of worker 1: size '8XB' is not a number of bytes"),
        (["--budgets", "80GB,80GB", "-K", "3"], "--budgets gives 2 sizes but -K is 3"),
        ([], "--costs needs -K WORKERS or --budgets"),
        (["-K", "4", "-B", "9"], "-B 9 but"),
        (["-K", "4", "--construction", "cyclic"], "--construction cyclic does not apply to --costs"),
        (["-K", "4", "--min-coverage", "5"], "min_coverage=5 must lie in [1, K] = [1, 4]"),
        (["-K", "4", "--schedule", "permute", "--budgets", "80GB,80GB,15GB,15GB"],
         "--schedule permute: worker 2 would hold"),
    ],
)
def test_bad_costs_arguments_exit_2_with_one_line(capsys, tmp_path, costs_file, argv, message):
    out = tmp_path / "m.json"
    assert main(["design", "--costs", str(costs_file), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp design: error:") and message in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--costs", "/nonexistent/costs.json", "-K", "2"], "no such costs file"),
        (["-K", "4", "-B", "4", "--coverage", "2", "--budgets", "1GB,1GB,1GB,1GB"], "--budgets belongs to --costs"),
        (["-K", "4", "-B", "4", "--active", "0.5", "--min-coverage", "2"], "--min-coverage belongs to --costs"),
        (["-K", "4", "--coverage", "2"], "give -K WORKERS -B BLOCKS and one of --active C, --coverage c"),
    ],
)
def test_costs_flags_without_costs_and_missing_files_exit_2(capsys, argv, message):
    assert main(["design", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# -- sdp design --max-groups -------------------------------------------------------------------
def test_max_groups_keeps_the_groups_and_shows_the_gap_against_the_unconstrained_design(capsys):
    free = _run_json(capsys, ["design", "-K", "9", "-B", "36", "--coverage", "3", "--json"])
    limited = _run_json(capsys, ["design", "-K", "9", "-B", "36", "--coverage", "3", "--max-groups", "12", "--json"])
    assert free["process_groups"] > 12 >= limited["process_groups"]
    first, *rest = limited["group_tradeoff"]
    assert (first["process_groups"], first["spectral_gap"]) == (free["process_groups"], free["spectral_gap"])
    chosen = [row for row in limited["group_tradeoff"] if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["spectral_gap"] == limited["spectral_gap"]
    assert limited["optimality_ratio"] == pytest.approx(1.0, abs=1e-9)  # the affine plane's lines, repeated
    assert main(["design", "-K", "9", "-B", "36", "--coverage", "3", "--max-groups", "12"]) == 0
    text = capsys.readouterr().out
    assert "  groups  spectral gap  optimality ratio  construction" in text
    assert "affine-plane-repeated  <- chosen" in text


def test_max_groups_large_enough_prints_the_same_certificate_as_without(capsys):
    free = _run_json(capsys, ["design", "-K", "8", "-B", "12", "--active", "0.5", "--seed", "4", "--json"])
    limited = _run_json(capsys, ["design", "-K", "8", "-B", "12", "--active", "0.5", "--seed", "4", "--json",
                                 "--max-groups", str(free["process_groups"])])
    assert {k: v for k, v in limited.items() if k not in ("max_groups", "group_tradeoff")} == free
    assert [row["chosen"] for row in limited["group_tradeoff"]] == [True]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-groups", "3"], "max_groups=3: holder sets of coverage=2 workers cover all K=8 workers only with"),
        (["--max-groups", "-1"], "max_groups=-1 must be an integer >= 0"),
        (["--max-groups", "4", "--construction", "cyclic"], "--max-groups applies to --construction auto"),
    ],
)
def test_bad_max_groups_exit_2_with_one_line(capsys, argv, message):
    assert main(["design", "-K", "8", "-B", "16", "--coverage", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_design_costs_with_max_groups_keeps_them(capsys, costs_file):
    report = _run_json(capsys, ["design", "--costs", str(costs_file), "-K", "4", "--max-groups", "2", "--json"])
    assert report["process_groups"] <= 2 and report["coverage_min"] == 2
    assert report["largest_worker_bytes"] == report["bytes_lower_bound"]
