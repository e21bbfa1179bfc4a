"""The image presets of ``sdp compare`` (issue 28): DDP against B-, N- and Bb-SDP at the paper's C
values on CIFAR-format batches, with top-1 accuracy in every row; the CPU smoke preset trains for
real on generated files."""

from __future__ import annotations

import json

import torch

from sdp_train.cli import main
from sdp_train.compare import runner as compare_mod
from sdp_train.compare.runner import PRESETS, plan_runs
from tests.cifar_files import write_cifar_dir


def test_the_image_presets_run_every_sdp_mode_at_the_papers_c_values(tmp_path):
    for name in ("cifar10", "cifar100"):
        for model in ("resnet18", "wrn18", "swin-tiny"):
            preset = PRESETS[f"{name}-{model}"]
            assert preset.workers == 8 and preset.gpus and preset.needs_data == "cifar"
            assert dict(preset.model_overrides).get("num_classes", 10) == (100 if name == "cifar100" else 10)
    root = write_cifar_dir(tmp_path / "data")
    preset = compare_mod.replace(PRESETS["cifar10-resnet18"], data=f"cifar:{root}")
    planned = {p.spec.name: p for p in plan_runs(preset, tmp_path / "plan")}
    assert list(planned) == ["ddp", *(f"{mode}-C{c}" for c in ("0.375", "0.5", "0.75")
                                      for mode in ("bsdp", "nsdp", "bbsdp"))]
    for name, p in planned.items():  # every label carries the C its mask realises: c of 8 workers
        if name != "ddp":
            assert f"C{p.mask.active_fraction:.4g}" in name and p.verification["verified"]


def test_an_image_preset_without_its_data_is_refused_in_one_line(tmp_path, capsys):
    assert main(["compare", "--preset", "cpu-cifar", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pass --data cifar:DIR" in err, err
    assert not (tmp_path / "cmp").exists()
    # a GPU image preset on this CPU machine points at the CPU image preset, not the language one
    root = write_cifar_dir(tmp_path / "data", train=64, test=32)
    if not torch.cuda.is_available():
        assert main(["compare", "--preset", "cifar10-resnet18", "--data", f"cifar:{root}",
                     "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "The cpu-cifar preset runs on CPUs" in err, err


def test_the_cpu_cifar_smoke_comparison_trains_every_system_and_reports_accuracy(tmp_path, monkeypatch):
    """The preset's systems are DDP, B-SDP, N-SDP and Bb-SDP at C = 0.5 on learnable generated images
    (10 classes, chance 10%). Two of them are trained here, in two 2-rank launches (each costs the
    suite about 15 CPU-s): DDP, which must learn them, and N-SDP, whose assembled model is the
    hardest to score: on 2 workers each trains a disjoint half of every layer's channels, which
    never train together (33% at d8ccfa3; B-SDP 23%, Bb-SDP 66%: BENCHMARKS.md, "CIFAR smoke",
    trains all four). B-SDP's and Bb-SDP's training on ResNets is checked against references in
    tests/distributed/test_sdp_training.py."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the suite's default; the ranks' kernels need none on CPU
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root = write_cifar_dir(tmp_path / "data")
    out = tmp_path / "cmp"
    systems = compare_mod.run_specs(PRESETS["cpu-cifar"])
    assert [s.name for s in systems] == ["ddp", "bsdp-C0.5", "nsdp-C0.5", "bbsdp-C0.5"]
    monkeypatch.setattr(compare_mod, "run_specs", lambda preset: [s for s in systems if s.mode in ("ddp", "nsdp")])
    assert main(["compare", "--preset", "cpu-cifar", "--data", f"cifar:{root}", "--out", str(out)]) == 0
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert list(runs) == ["ddp", "nsdp-C0.5"]
    for name, row in runs.items():
        summary = json.loads((out / "runs" / name / "summary.json").read_text())
        # 2 ranks x 4 batches of 16 test images: accuracy is a count of them
        assert round(row["final_val_accuracy"] * 128, 6) == round(row["final_val_accuracy"] * 128)
        assert row["final_val_accuracy"] == summary["final_val_accuracy"] == row["val_history"][-1]["val_accuracy"]
        assert "val_accuracy" in summary["val_history"][0]
        assert row["final_val_accuracy_minus_ddp"] == row["final_val_accuracy"] - runs["ddp"]["final_val_accuracy"]
    assert runs["ddp"]["final_val_accuracy"] > 0.5
    # with its BatchNorm statistics recomputed on the assembled model (bn_recalibration, on by
    # default in bsdp and nsdp) N-SDP scores above chance; without it, 14 of 128: chance
    assert runs["nsdp-C0.5"]["final_val_accuracy"] > 0.15
    table = (out / "compare.md").read_text()
    assert "| val acc | - DDP |" in table and "16 images per worker per step" in table
