"""`sdp compare`: masks designed and certified first, every system trained for real, a report
with ratios to DDP, FLOP matching, duplicate masks of a C sweep not retrained, and a re-run that
skips what finished and adds a second seed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sdp_train.cli import main
from sdp_train.compare.runner import Preset, RunSpec, compare, flops_per_step, plan_runs
from sdp_train.compare import runner as compare_mod
from sdp_train.compare.stats import LARGER, WITHIN
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig

TINY = Preset(model="llama-debug", workers=3, steps=4, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1,
              active=2 / 3, sweep=(1 / 3,), eval_every=2, eval_batches=1, max_data_bytes=100_000, memory_steps=1)
# What test_compare_trains_reports_and_resumes trains: each system is one launch, of 2 ranks (a
# rank costs the suite about 5 CPU-s to start). The FLOP-matched run is not trained here: it is the
# same B-SDP with more steps, which test_plan_certifies_every_mask_and_matches_flops checks, and the
# report multiplies a run's configured steps by its FLOPs per step (checked on the bsdp row below).
TRAINED = Preset(**{**TINY.__dict__, "workers": 2, "active": 0.5, "sweep": (1.0,)})
SPECS = [RunSpec("ddp", "ddp"), RunSpec("bsdp", "bsdp", 0.5), RunSpec("bsdp-C1", "bsdp", 1.0)]
RUN_SPECS = compare_mod.run_specs  # the `tiny` fixture replaces it with SPECS


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(compare_mod.PRESETS, "tiny", TRAINED)
    monkeypatch.setattr(compare_mod, "run_specs", lambda preset: list(SPECS))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_flops_per_step_follow_the_dense_estimate():
    cfg = TrainConfig(model="llama-debug", mode="ddp", batch_size=2, seq_len=16)
    from sdp_train.models import get_model_config, num_params

    n = num_params(get_model_config("llama-debug"))
    assert flops_per_step(cfg, None) == 6 * 32 * n
    ac = TrainConfig(model="llama-debug", mode="ddp", batch_size=2, seq_len=16, activation_checkpointing=True)
    assert flops_per_step(ac, None) == 8 * 32 * n


def test_preset_c_is_realised_exactly_or_refused_and_labels_carry_it():
    sixteen = Preset(**{**TINY.__dict__, "workers": 16, "active": 0.5, "sweep": (0.375, 0.69, 0.6875, 1.0)})
    swept = {s.name: s.active for s in RUN_SPECS(sixteen) if s.name.startswith("bsdp-C")}
    assert swept == {"bsdp-C0.375": 6 / 16, "bsdp-C0.6875": 11 / 16, "bsdp-C1": 1.0}  # 0.69 is 11/16: one run
    with pytest.raises(ConfigError, match=r"preset llama-debug on 4 workers: C = 0.69 is not c/K within 0.005 for "
                                          r"K = 4 workers \(nearest: C = 0.5 with c = 2, C = 0.75 with c = 3\); it "
                                          r"needs K = 13 \(c = 9\), or with a multiple of 4 workers K = 16 \(c = 11\)"):
        RUN_SPECS(Preset(**{**TINY.__dict__, "workers": 4, "active": 0.5, "sweep": (0.69,)}))
    for name, preset in compare_mod.PRESETS.items():  # every shipped preset trains the C its labels say
        for spec in RUN_SPECS(preset):
            if spec.active is not None:
                c = round(spec.active * preset.workers)
                assert spec.active == c / preset.workers, (name, spec)
            if spec.name.startswith("bsdp-C"):
                assert float(spec.name.removeprefix("bsdp-C")) == pytest.approx(spec.active, abs=5e-5), (name, spec)


def test_plan_certifies_every_mask_and_matches_flops(tmp_path, tiny):
    four = Preset(**{**TINY.__dict__, "workers": 4, "active": 0.5, "sweep": (0.25,)})
    specs = [RunSpec("ddp", "ddp"), RunSpec("bsdp", "bsdp", 0.5), RunSpec("bsdp-flop-matched", "bsdp", 0.5,
             flop_matched=True), RunSpec("bsdp-hetero", "bsdp", 0.5, heterogeneous=True)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compare_mod, "run_specs", lambda preset: specs)
        planned = {p.spec.name: p for p in plan_runs(four, tmp_path)}
    assert planned["bsdp-hetero"].config.heterogeneous and not planned["bsdp"].config.heterogeneous
    assert planned["bsdp-hetero"].config.mask != planned["bsdp"].config.mask  # each run its own file
    assert planned["ddp"].mask is None and planned["ddp"].verification is None
    bsdp = planned["bsdp"]
    assert bsdp.verification["verified"] and bsdp.verification["certificate"]["spectral_gap"] > 0
    assert TrainConfig(**json.loads(json.dumps(bsdp.config.to_dict()))).mask == str(tmp_path / "masks" / "bsdp.json")
    ratio = planned["ddp"].flops_per_step / bsdp.flops_per_step
    assert 1 < ratio < 2
    assert planned["bsdp-flop-matched"].config.steps == math.ceil(TINY.steps * ratio)
    # with K=3, C=1/3 designs a disconnected mask: the certificate says so, but no theorem of the
    # stepwise regime needs a connected mixing graph, so it is not a failed condition
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compare_mod, "run_specs", lambda preset: [RunSpec("bsdp-C0.3333", "bsdp", 1 / 3)])
        k3 = {p.spec.name: p for p in plan_runs(TINY, tmp_path / "k3")}["bsdp-C0.3333"]
    assert not k3.verification["certificate"]["connected"] and k3.verification["verified"]
    assert list(k3.verification["conditions"]) == ["every block held (coverage >= 1)"]
    # forward-masked B-SDP is covered by no theorem: no bound ratio is printed for it
    assert bsdp.verification["bound_vs_ddp"] is None and bsdp.verification["theorem"] is None
    assert bsdp.verification["sgd_bound_vs_ddp"] is None and bsdp.verification["sgd_theorem"] is None
    bb = compare_mod.certify(bsdp.mask, 100, "bbsdp")  # plain constant-step SGD: Theorem 1 covers it
    assert bb["theorem"] is not None and bb["bound_vs_ddp"] > 1
    # as sdp train runs it (AdamW, warm-up, cosine decay, clipping) no theorem does: a design figure only
    adamw = compare_mod.certify(bsdp.mask, 100, "bbsdp", training=compare_mod.training_rule(bsdp.config))
    assert adamw["theorem"] is None and adamw["bound_vs_ddp"] is None and "adamw" in adamw["not_covered"]
    assert adamw["sgd_theorem"] == bb["theorem"] and adamw["sgd_bound_vs_ddp"] == bb["bound_vs_ddp"]
    assert "design figure (heuristic, not a guarantee for this run)" in compare_mod._bound_text(adamw)


@pytest.mark.slow
def test_compare_trains_reports_and_resumes(tmp_path, tiny, capsys, monkeypatch):
    out = tmp_path / "cmp"
    certify = compare_mod.certify

    def refusing_full_c(mask, steps, mode, **kw):  # the path of a mask that fails a condition
        result = certify(mask, steps, mode, **kw)
        if mask.active_fraction > 0.9:
            result["conditions"]["test: C above 0.9 refused"] = False
            result["verified"] = False
        return result

    monkeypatch.setattr(compare_mod, "certify", refusing_full_c)
    assert main(["compare", "--preset", "tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mask bsdp: C=0.500" in printed and "verified" in printed
    report = json.loads((out / "compare.json").read_text())
    runs = report["runs"]
    assert set(runs) == {"ddp", "bsdp"}
    assert report["not_run"] == {"bsdp-C1": "its mask failed verification"}
    assert "mask bsdp-C1: C=1.000" in printed and "FAILED: test: C above 0.9 refused" in printed
    assert runs["ddp"]["final_val_loss_vs_ddp"] == 1.0 and runs["ddp"]["peak_memory_vs_ddp"] == 1.0
    assert runs["bsdp"]["peak_memory_vs_ddp"] < 1.0 and runs["bsdp"]["comm_bytes_per_step_vs_ddp"] < 1.0
    assert runs["bsdp"]["training_flops_vs_ddp"] < 1.0 and runs["bsdp"]["steps"] == TINY.steps
    for row in runs.values():
        assert math.isfinite(row["final_val_loss"]) and row["val_history"][-1]["step"] == row["steps"] - 1
    table = (out / "compare.md").read_text()
    assert "| bsdp | 0.5 |" in table and "Not run: `bsdp-C1`" in table
    assert table in printed
    for png in ("compare_loss.png", "compare_cost.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # seeds added later (and an interrupted comparison resumed): --seeds 2 skips every finished
    # seed-0 run and trains only seed 1's, with the same masks (two systems, to keep the test short)
    monkeypatch.setattr(compare_mod, "run_specs", lambda preset: list(SPECS[:2]))
    before = (out / "runs" / "ddp" / "summary.json").stat().st_mtime_ns
    lines: list[str] = []
    again = compare("tiny", out, seeds=2, log=lines.append)
    assert [line for line in lines if "skipped" in line] == [
        "[1/4] ddp (seed 0): finished earlier, skipped", "[2/4] bsdp (seed 0): finished earlier, skipped"]
    trained = [line.split(":")[0] for line in lines if ": training" in line]
    assert trained == ["[3/4] ddp (seed 1)", "[4/4] bsdp (seed 1)"]
    assert (out / "runs" / "ddp" / "summary.json").stat().st_mtime_ns == before
    assert again["runs"]["ddp"]["final_val_loss"] == runs["ddp"]["final_val_loss"]
    seed1 = json.loads((out / "runs" / "bsdp" / "seed_1" / "summary.json").read_text())
    assert seed1["config"]["seed"] == 1 and seed1["config"]["mask"] == runs["bsdp"]["mask_file"]
    other = again["seed_runs"]["1"]
    assert other["ddp"]["final_val_loss"] != runs["ddp"]["final_val_loss"]  # another init and data order
    stats = again["seed_stats"]["runs"]
    assert stats["ddp"]["final_val_loss_minus_ddp"]["verdict"] == WITHIN
    assert stats["bsdp"]["final_val_loss_minus_ddp"]["mean"] == pytest.approx(
        (runs["bsdp"]["final_val_loss"] - runs["ddp"]["final_val_loss"]
         + other["bsdp"]["final_val_loss"] - other["ddp"]["final_val_loss"]) / 2)
    assert stats["bsdp"]["final_val_loss_minus_ddp"]["verdict"] in (LARGER, WITHIN)
    assert stats["bsdp"]["peak_memory_vs_ddp"]["sd"] == 0.0  # the same shapes at every seed
    assert again["command"] == "sdp compare --preset tiny --seeds 2"
    assert "Over 2 seeds (0, 1;" in (out / "compare.md").read_text()


def test_the_overlap_preset_compares_two_masks_of_one_coverage_and_different_gamma(tmp_path):
    planned = {p.spec.name: p for p in plan_runs(compare_mod.PRESETS["cpu-overlap"], tmp_path)}
    fano, rand = (planned[n].verification for n in ("overlap-permute", "overlap-permute-random"))
    assert planned["overlap-permute"].mask.construction == "projective-plane"
    assert np.array_equal(planned["overlap-permute"].mask.coverage, planned["overlap-permute-random"].mask.coverage)
    assert fano["matrix_spectral_gap"] == pytest.approx(1 / 3) and rand["matrix_spectral_gap"] < 0.2
    # under permute Theorem 4's gap is the per-block (c - 1)/(K - 1) for both: what the runs test
    assert fano["consensus_gap"] == pytest.approx(rand["consensus_gap"]) == pytest.approx(2 / 6)
    static = planned["overlap-static"].verification
    assert static["consensus_gap"] == 0 and static["sgd_bound_infinite"] and static["sgd_bound_vs_ddp"] is None
    assert static["sgd_theorem"] == fano["sgd_theorem"] == "Theorem 6" and math.isfinite(fano["sgd_bound_vs_ddp"])
    assert static["theorem"] is fano["theorem"] is None and fano["bound_vs_ddp"] is None  # AdamW: no theorem
    assert planned["overlap-permute"].config.every == planned["overlap-permute"].config.local_steps == 2
    # B-SDP static against B-SDP under permute: trained, and marked as covered by no theorem
    bsdp = planned["bsdp-permute"]
    assert (bsdp.config.mode, bsdp.config.schedule, bsdp.config.every) == ("bsdp", "permute", 2)
    # forward-masked overlap averaging: B-SDP with local steps, static and under permute, no theorem
    for name, schedule in (("bsdp-local", None), ("bsdp-local-permute", "permute")):
        local = planned[name]
        assert (local.config.mode, local.config.local_steps, local.config.schedule) == ("bsdp", 2, schedule)
        assert local.verification["theorem"] is None and local.verification["bound_vs_ddp"] is None
    assert all(p.config.model_overrides == {"n_layers": 7} for p in planned.values())


TINY_OVERLAP = Preset(model="llama-debug", workers=3, steps=4, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1,
                      active=2 / 3, eval_every=2, eval_batches=1, max_data_bytes=100_000, memory_steps=1,
                      model_overrides=(("n_layers", 3),), overlap=True)


@pytest.mark.slow
def test_overlap_rows_report_consensus_beside_theorem_4(tmp_path, monkeypatch):
    # overlap-permute trained beside DDP; a static mask's infinite bound, its "(inf)" cell, is
    # planned in test_the_overlap_preset_compares_two_masks... and rendered in test_compare_report
    monkeypatch.setitem(compare_mod.PRESETS, "tiny-overlap", TINY_OVERLAP)
    kept = ("ddp", "overlap-permute")
    monkeypatch.setattr(compare_mod, "run_specs",
                        lambda preset: [s for s in compare_mod.overlap_specs(preset) if s.name in kept])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cmp"
    report = compare("tiny-overlap", out, log=lambda line: None)
    runs = report["runs"]
    assert set(runs) == set(kept) and "consensus_history" not in runs["ddp"]
    for name in kept[1:]:
        history = runs[name]["consensus_history"]
        assert [h["step"] for h in history] == [1, 3] and all(h["total"] > 0 for h in history)
        assert runs[name]["local_steps"] == 2 and runs[name]["comm_bytes_per_step_vs_ddp"] < 1
    permute = runs["overlap-permute"]
    assert permute["schedule"] == "permute" and not permute["sgd_bound_infinite"]
    json.loads((out / "compare.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    table = (out / "compare.md").read_text()
    assert "| overlap-permute | permute | 2 | " in table
    assert (out / "compare_consensus.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_preset_and_bad_out_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--preset", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert main(["compare", "--out", str(not_a_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sdp compare: error: --out {not_a_dir} exists and is not a directory"]


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 4, reason="this machine could run the GPU preset")
def test_a_gpu_preset_without_its_gpus_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    assert main(["compare", "--preset", "gpu-134m", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp compare: error: preset gpu-134m runs one rank per CUDA device "
                                               "and needs 4; this machine has "), err
    assert not (tmp_path / "cmp" / "runs").exists()


def test_a_gpu_preset_is_refused_where_sdp_plan_predicts_a_run_beyond_the_smallest_device(tmp_path):
    from sdp_train.compare.runner import Planned, base_config, check_devices, predicted_peak

    preset = compare_mod.PRESETS["gpu-134m"]
    assert preset.dtype == "bfloat16" and preset.gpus
    specs = [RunSpec("ddp", "ddp"), RunSpec("fsdp+ac", "fsdp", ac=True)]
    planned = [Planned(s, base_config(preset, s, tmp_path), None, 1.0, None) for s in specs]
    assert all(p.config.dtype == "bfloat16" for p in planned)
    ddp, small = (predicted_peak(preset, p) for p in planned)
    assert small < ddp
    check_devices("gpu-134m", preset, planned, [ddp] * 4)  # fits exactly
    gib = 2**30
    with pytest.raises(ConfigError, match=r"preset gpu-134m does not fit: sdp plan predicts per-device peaks beyond "
                                          r"the .* of the smallest of its 4 CUDA devices for 1 of 2 runs \(ddp "):
        check_devices("gpu-134m", preset, planned, [ddp + gib, ddp + gib, ddp - 1, ddp + gib, 1])
    with pytest.raises(ConfigError, match="needs 4; this machine has 3"):
        check_devices("gpu-134m", preset, planned, [ddp] * 3)
