"""Checkpoint integrity on one process: a checkpoint whose write was interrupted or whose bytes changed
is detected and the previous complete one is used (with a warning), rotation keeps exactly N, a
restarted attempt resumes by itself, and a non-finite step is stopped or skipped as configured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sdp_train.data import build_batches
from sdp_train.errors import ConfigError, NonFiniteError
from sdp_train.parallel.dist import DistInfo
from sdp_train.trainer.checkpoint import (
    MANIFEST,
    checkpoint_problem,
    find_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run
from sdp_train.trainer.train import resume_after_restart

TINY = {"model": "llama-debug", "model_overrides": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},
        "mode": "ddp", "workers": 1, "steps": 8, "batch_size": 2, "seq_len": 16, "max_data_bytes": 20_000,
        "warmup_steps": 1, "memory_steps": 0, "eval_batches": 1, "checkpoint_every": 2}


def _run(tmp_path: Path, **kw) -> tuple[Run, object]:
    prep = prepare(TrainConfig(**{**TINY, **kw, "out": str(tmp_path)}))
    run = Run(prep, DistInfo(0, 1, 0), torch.device("cpu"))
    batches = build_batches(prep.data, split="train", seed=0, rank=0, world_size=1)
    return run, batches


def _train_steps(run: Run, batches, steps: range) -> list[dict]:
    return [run.step(s, *next(batches)) for s in steps]


@pytest.fixture
def two_checkpoints(tmp_path) -> Path:
    """``tmp_path/checkpoints`` with complete checkpoints step_2 and step_4 of a tiny run."""
    run, batches = _run(tmp_path)
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        _train_steps(run, batches, range(step - 2, step))
        save_checkpoint(run, batches, step, root)
    return root


def _drop_manifest(path: Path) -> None:
    (path / MANIFEST).unlink()


def _truncate(path: Path) -> None:
    data = (path / "rank0.pt").read_bytes()
    (path / "rank0.pt").write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray((path / "rank0.pt").read_bytes())
    data[len(data) // 3] ^= 0xFF
    (path / "rank0.pt").write_bytes(bytes(data))


DAMAGE = {
    "interrupted write": (_drop_manifest, "it has no manifest.json, so its write was interrupted"),
    "truncated rank file": (_truncate, "(truncated or altered)"),
    "altered byte": (_flip_byte, "does not match its sha256 checksum in the manifest (its bytes were altered)"),
}


def test_manifest_records_size_sha256_mask_model_config_and_world_size(two_checkpoints):
    manifest = json.loads((two_checkpoints / "step_4" / MANIFEST).read_text())
    entry = manifest["files"]["rank0.pt"]
    assert entry["size"] == (two_checkpoints / "step_4" / "rank0.pt").stat().st_size
    assert len(entry["sha256"]) == 64
    assert {"model_config", "world_size", "mask"} <= set(manifest["identity"])
    assert checkpoint_problem(two_checkpoints / "step_4") is None
    assert not list(two_checkpoints.glob("step_*/.*"))  # no temporary files left behind


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(two_checkpoints, capsys, damage):
    harm, reason = DAMAGE[damage]
    harm(two_checkpoints / "step_4")
    assert find_checkpoint(two_checkpoints) == two_checkpoints / "step_2"
    err = capsys.readouterr().err
    assert f"sdp: warning: checkpoint {two_checkpoints / 'step_4'} skipped: " in err and reason in err, err
    assert "trying the previous one" in err


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_checkpoint_named_explicitly_is_an_error_naming_the_reason(two_checkpoints, damage):
    harm, reason = DAMAGE[damage]
    harm(two_checkpoints / "step_4")
    with pytest.raises(ConfigError, match="step_4'?: cannot resume from this checkpoint: ") as err:
        find_checkpoint(two_checkpoints / "step_4")
    assert reason in str(err.value)


def test_resume_after_fallback_restores_the_previous_checkpoint_exactly(two_checkpoints, tmp_path):
    _flip_byte(two_checkpoints / "step_4")
    prep = prepare(TrainConfig(**{**TINY, "resume": str(two_checkpoints), "out": str(tmp_path)}))
    assert prep.resume_from == two_checkpoints / "step_2"
    run, batches = _run(tmp_path)
    assert load_checkpoint(run, batches, prep.resume_from) == 2
    saved = torch.load(two_checkpoints / "step_2" / "rank0.pt", weights_only=True)
    assert all(torch.equal(run.model.state_dict()[n], t) for n, t in saved["model"].items())


def test_no_valid_checkpoint_is_an_error_or_none(two_checkpoints):
    _drop_manifest(two_checkpoints / "step_2")
    _truncate(two_checkpoints / "step_4")
    assert latest_valid_checkpoint(two_checkpoints) is None
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_checkpoint(two_checkpoints)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_rotation_keeps_exactly_the_newest_n_complete_checkpoints(tmp_path, keep):
    run, batches = _run(tmp_path)
    root = tmp_path / "checkpoints"
    (root / "step_1").mkdir(parents=True)  # an interrupted write: rotation removes it too
    for step in range(2, 7):
        save_checkpoint(run, batches, step, root, keep=keep)
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s}" for s in range(7 - keep, 7)]


def test_keep_zero_keeps_every_checkpoint(tmp_path):
    run, batches = _run(tmp_path)
    for step in range(1, 4):
        save_checkpoint(run, batches, step, tmp_path / "checkpoints", keep=0)
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3


def test_restarted_attempt_resumes_from_the_newest_valid_checkpoint(two_checkpoints, tmp_path, monkeypatch, capsys):
    prep = prepare(TrainConfig(**{**TINY, "out": str(tmp_path)}))
    assert resume_after_restart(prep).resume_from is None  # first attempt: no automatic resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    (two_checkpoints / "step_6").mkdir()  # the failed attempt was writing this one
    assert resume_after_restart(prep).resume_from == two_checkpoints / "step_4"
    assert "step_6 skipped: it has no manifest.json" in capsys.readouterr().err
    no_ckpt = prepare(TrainConfig(**{**TINY, "checkpoint_every": 0, "out": str(tmp_path)}))
    assert resume_after_restart(no_ckpt).resume_from is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("nonfinite", "ignore", "nonfinite='ignore' is not one of ('stop', 'skip')"),
    ("keep_checkpoints", -1, "keep_checkpoints=-1 must be an integer >= 0"),
    ("max_restarts", 1.5, "max_restarts=1.5 must be an integer >= 0"),
])
def test_reliability_fields_are_validated_naming_the_value(field, value, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{field: value})
    assert message in str(err.value)


def test_nonfinite_stop_raises_a_report_naming_step_loss_and_gradient_norm(tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_TEST_INJECT_NAN", "1:0")  # read once, when the run is built
    run, batches = _run(tmp_path, nonfinite="stop")
    _train_steps(run, batches, range(1))
    stats = _train_steps(run, batches, range(1, 2))[0]  # decided when its values are read, not in the step
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite .*mean loss nan, averaged gradient norm nan"):
        run.finish(1, stats)


def test_nonfinite_skip_leaves_parameters_and_optimizer_state_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_TEST_INJECT_NAN", "1:0")
    run, batches = _run(tmp_path, nonfinite="skip")
    _train_steps(run, batches, range(1))
    params = {n: t.clone() for n, t in run.model.state_dict().items()}
    optim = [{k: v.clone() for k, v in s.items()} for s in run.optimizer.state.values()]
    (skipped,) = _train_steps(run, batches, range(1, 2))
    assert skipped["skipped"] and math.isnan(skipped["loss"]) and math.isnan(skipped["grad_norm"])
    assert all(torch.equal(run.model.state_dict()[n], t) for n, t in params.items())
    assert all(torch.equal(s[k], v) for s, saved in zip(run.optimizer.state.values(), optim) for k, v in saved.items())
    assert all(not p.grad.any() for p in run.model.parameters())  # the NaN gradients are gone
    (after,) = _train_steps(run, batches, range(2, 3))
    assert not after["skipped"] and math.isfinite(after["loss"]) and math.isfinite(after["grad_norm"])


def test_a_restart_resumes_only_checkpoints_of_its_own_launch_and_config(two_checkpoints, tmp_path, monkeypatch,
                                                                          capsys):
    """An older run's checkpoints in --out (another launch, or another config) are never continued.

    Before: a restart compared model, mode, world size, fsdp and mask only, and resumed another
    run's final checkpoint (trained with another --lr) and reported its loss as its own.
    """
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    other_lr = prepare(TrainConfig(**{**TINY, "lr": 0.001, "out": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"config.lr: checkpoint 0.003, this run 0.001"):
        resume_after_restart(other_lr)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                        "TORCHELASTIC_RUN_ID": "a-later-launch"}.items():
        monkeypatch.setenv(name, value)
    prep = prepare(TrainConfig(**{**TINY, "out": str(tmp_path)}))
    assert resume_after_restart(prep).resume_from is None
    assert "written by another launch (run id None, this one 'a-later-launch')" in capsys.readouterr().err


def test_an_explicit_resume_with_another_seed_is_refused(two_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="seed: checkpoint 0, this run 5"):
        prepare(TrainConfig(**{**TINY, "seed": 5, "resume": str(two_checkpoints), "out": str(tmp_path)}))


def _rewrite_manifest(path: Path, change) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m["identity"].update(world_size=10**15), "identity.world_size=1000000000000000; expected"),
    (lambda m: m.update(step=-1), "step=-1; expected an integer"),
    (lambda m: m.pop("step"), "step=None; expected an integer"),
    (lambda m: m["identity"].pop("mode"), "no identity with mode"),
])
def test_crafted_manifest_fields_are_refused_naming_the_field(two_checkpoints, change, message):
    step = two_checkpoints / "step_4"
    _rewrite_manifest(step, change)
    with pytest.raises(ConfigError, match=message):
        find_checkpoint(step)


def test_a_deeply_nested_manifest_is_refused_not_a_recursion_error(two_checkpoints):
    step = two_checkpoints / "step_4"
    (step / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        find_checkpoint(step)
    assert find_checkpoint(two_checkpoints) == two_checkpoints / "step_2"  # the previous one is used instead


def test_a_rank_file_replaced_by_a_symlink_is_refused(two_checkpoints):
    step = two_checkpoints / "step_4"
    (step / "rank0.pt").unlink()
    (step / "rank0.pt").symlink_to(two_checkpoints / "step_2" / "rank0.pt")
    with pytest.raises(ConfigError, match="rank0.pt is a symbolic link"):
        find_checkpoint(step)


def _recraft_rank_file(path: Path, change) -> None:
    """Alter rank0.pt and recompute its size and sha256 in the manifest, so only content checks can tell."""
    file = path / "rank0.pt"
    state = torch.load(file, weights_only=True)
    change(state)
    torch.save(state, file)
    digest = __import__("hashlib").sha256(file.read_bytes()).hexdigest()
    _rewrite_manifest(path, lambda m: m["files"]["rank0.pt"].update(size=file.stat().st_size, sha256=digest))


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["model"].update({next(k for k, v in s["model"].items() if v.dim() == 2): torch.tensor(1.0)}),
     r"model\..*: \(\) torch.float32, this rank's model has \("),
    (lambda s: s.update(step=2), "step: 2, but the manifest says 4"),
    (lambda s: s["data"].update(step=10**30), "data.step: 10{30}, but the checkpoint is at step 4"),
    (lambda s: s["rng"].update(torch=torch.zeros(3)), "rng.torch: not a torch RNG state"),
    (lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(1)), r"optimizer.state\[0\].exp_avg"),
    (lambda s: s["optimizer"]["param_groups"].append({"params": [99]}), r"optimizer.param_groups: groups of \["),
    (lambda s: s["data"].update(rank=1), "data: cannot resume a data stream with rank=0 from a state with rank=1"),
])
def test_crafted_rank_files_with_a_valid_checksum_are_refused_before_any_tensor_is_loaded(
        two_checkpoints, tmp_path, change, message):
    step = two_checkpoints / "step_4"
    _recraft_rank_file(step, change)
    run, batches = _run(tmp_path)
    before = {n: t.clone() for n, t in run.model.state_dict().items()}
    with pytest.raises(ConfigError, match=message) as err:
        load_checkpoint(run, batches, step)
    assert str(step / "rank0.pt") in str(err.value)
    assert all(torch.equal(before[n], t) for n, t in run.model.state_dict().items())  # nothing half-loaded
    assert batches.step == 0


class _Payload:
    """Unpickling this would create the file `marker`: a stand-in for code run by a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _rehash(path: Path) -> None:
    file = path / "rank0.pt"
    digest = __import__("hashlib").sha256(file.read_bytes()).hexdigest()
    _rewrite_manifest(path, lambda m: m["files"]["rank0.pt"].update(size=file.stat().st_size, sha256=digest))


def _with_rng(state: torch.Tensor):
    def craft(file: Path) -> None:
        saved = torch.load(file, weights_only=True)
        saved["rng"]["torch"] = state
        torch.save(saved, file)
    return craft


CRAFTED_FILES = {
    "malicious pickle in a torch archive": (lambda f, marker: torch.save({"step": 4, "x": _Payload(marker)}, f),
                                            "holds objects other than tensors"),
    "malicious raw pickle": (lambda f, marker: f.write_bytes(__import__("pickle").dumps(_Payload(marker))),
                             "holds objects other than tensors"),
    "invalid RNG state": (lambda f, marker: _with_rng(torch.zeros(5056, dtype=torch.uint8))(f),
                          "rng.torch: not a torch RNG state (Invalid mt19937 state)"),
    "RNG state of the wrong size": (lambda f, marker: _with_rng(torch.zeros(3, dtype=torch.uint8))(f),
                                    "rng.torch: not a torch RNG state"),
    "truncated": (lambda f, marker: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
                  "is not a complete torch.save archive"),
    "empty": (lambda f, marker: f.write_bytes(b""), "is not a complete torch.save archive"),
}


@pytest.mark.parametrize("kind", list(CRAFTED_FILES))
def test_crafted_rank_files_are_one_error_naming_the_file_running_nothing_loading_nothing(
        two_checkpoints, tmp_path, recwarn, kind):
    craft, message = CRAFTED_FILES[kind]
    step, marker = two_checkpoints / "step_4", tmp_path / "payload-ran"
    craft(step / "rank0.pt", marker)
    _rehash(step)  # the manifest agrees: only reading the file can tell
    assert find_checkpoint(step) == step
    run, batches = _run(tmp_path)
    before = {n: t.clone() for n, t in run.model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        load_checkpoint(run, batches, step)
    text = str(err.value)
    assert text.startswith(f"checkpoint file {step / 'rank0.pt'}: ") and message in text, text
    assert "\n" not in text and "weights_only=False" not in text and "weights_only` set to `False" not in text
    assert not marker.exists()  # nothing in the file ran
    assert all(torch.equal(before[n], t) for n, t in run.model.state_dict().items())  # nothing half-loaded
    assert batches.step == 0
    assert [str(w.message) for w in recwarn] == []  # no torch warning about the file's pickle protocol
