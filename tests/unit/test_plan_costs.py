"""`sdp plan --budgets`: block costs from the memory model, and a mask whose predicted peak fits
each worker's device (`sdp_train.planning.costs`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab import DesignError, design_for_costs, load_costs, load_mask
from masklab.costs import worker_bytes
from sdp_train.cli import main
from sdp_train.planning.costs import block_costs, plan_for_budgets
from sdp_train.planning.memory import predict

TINY_RESNET = {"width_multiplier": 0.125, "in_channels": 1}
CONFIGS = {
    "llama-debug": dict(model="llama-debug", batch_size=2, seq_len=16),
    "tiny resnet": dict(model="resnet18-cifar", model_overrides=TINY_RESNET, batch_size=2),
}


def _predicted_peaks(setup, mask):
    kwargs = {k: v for k, v in setup.items() if k != "model"}
    return predict(setup["model"], mode="bsdp", workers=mask.workers, mask=mask, **kwargs)["per_rank"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_worker_holding_every_block_costs_its_fixed_plus_all_blocks_bytes(name):
    setup = CONFIGS[name]
    costs = block_costs(**setup)
    every = predict(setup["model"], mode="bsdp", workers=2, active=1.0,
                    **{k: v for k, v in setup.items() if k != "model"})
    # its state, bucket copy included, and the activations kept at the end of forward
    assert costs.fixed_bytes + costs.total_block_bytes == (sum(every["persistent"].values()) + every["buffers"]
                                                          + every["activations"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CONFIGS)), K=st.integers(2, 5), data=st.data())
def test_the_mask_for_feasible_budgets_covers_every_block_and_its_predicted_peaks_fit(name, K, data):
    setup = CONFIGS[name]
    costs = block_costs(**setup)
    c = data.draw(st.integers(1, min(K, 3)), label="min_coverage")
    # feasible by construction: the predicted peaks of the unbudgeted byte-balanced mask, each scaled up;
    # at least 15% up, since the overhead a worker learns from one mask may overstate it under another
    reference = design_for_costs(costs, K, min_coverage=c, seed=0)
    scale = data.draw(st.lists(st.floats(1.15, 1.6), min_size=K, max_size=K), label="scale")
    budgets = [int(p * s) for p, s in zip(_predicted_peaks(setup, reference), scale)]
    plan = plan_for_budgets(**setup, budgets=budgets, min_coverage=c)
    assert (plan.mask.coverage >= c).all()
    assert list(plan.peaks) == _predicted_peaks(setup, plan.mask)
    assert all(p <= b for p, b in zip(plan.peaks, budgets)), (plan.peaks, budgets)
    assert [row["fits"] for row in plan.rows] == [True] * K


def test_an_infeasible_budget_raises_naming_the_worker():
    setup = CONFIGS["llama-debug"]
    costs = block_costs(**setup)
    small = costs.fixed_bytes + min(costs.block_bytes) - 1  # below any worker's least possible load
    with pytest.raises(DesignError, match=r"^worker 2 "):
        plan_for_budgets(**setup, budgets=[10**9, 10**9, small, 10**9])


def test_the_plan_learns_the_overhead_the_costs_leave_out():
    # the costs leave out backward's temporaries and AdamW's foreach buffer: a budget equal to the
    # costs of the reference mask is too small for its predicted peak, yet a plan may still fit it
    setup = CONFIGS["tiny resnet"]
    costs = block_costs(**setup)
    reference = design_for_costs(costs, 4, seed=0)
    modeled, peaks = worker_bytes(reference, costs), _predicted_peaks(setup, reference)
    assert all(p > m for p, m in zip(peaks, modeled))
    plan = plan_for_budgets(**setup, budgets=[int(1.05 * p) for p in peaks])
    assert all(p <= b for p, b in zip(plan.peaks, plan.budgets))


def test_cli_prints_each_worker_and_writes_a_mask_and_costs_it_can_read(capsys, tmp_path):
    mask_file, costs_file = tmp_path / "mask.json", tmp_path / "costs.json"
    argv = ["plan", "--model", "llama-debug", "--workers", "4", "--budgets", "40MiB,40MiB,20MiB,20MiB",
            "--mask-out", str(mask_file), "--costs-out", str(costs_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[1] + r[2] for r in rows] == ["40.0MiB"] * 2 + ["20.0MiB"] * 2
    assert [r[-1] for r in rows] == ["yes"] * 4
    mask = load_mask(mask_file)
    assert mask.matrix.sum(axis=1).tolist() == [int(r[5]) for r in rows] == [3, 3, 1, 1]
    assert (mask.coverage == 2).all()
    assert load_costs(costs_file).blocks == 4


def test_cli_json_has_the_per_worker_rows(capsys):
    assert main(["plan", "--model", "llama-debug", "--workers", "2", "--budgets", "1GB,50MB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["budget"] for row in data["workers"]] == [10**9, 50 * 10**6]
    assert all(row["fits"] and row["peak"] <= row["budget"] for row in data["workers"])
    assert np.array(data["mask"]).sum(axis=0).tolist() == data["coverage"]


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "1GB,1GB,1KB,1GB"], "sdp plan: error: worker 2 "),
    (["--budgets", "1GB,1GB"], "--budgets gives 2 sizes but --workers is 4"),
    (["--budgets", "1GB,1GB,1GB,1GB", "--fsdp"], "leave out --fsdp"),
    (["--memory-per-device", "1GB", "--mask-out", "m.json"], "--mask-out belongs to --budgets"),
])
def test_cli_budget_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["plan", "--model", "llama-debug", "--workers", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
