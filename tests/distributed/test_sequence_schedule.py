"""`sdp train --mask FILE` with a user-given sequence of masks, on 2 real gloo ranks.

The sequence of a mask's rotations trains exactly what ``--schedule cyclic`` trains; sequences
whose rounds are no row permutation of each other (workers hold different numbers of blocks or
neuron groups from round to round) train in B-SDP, N-SDP and Bb-SDP, move state at every change
but none after the last step, resume in the middle of a round to the uninterrupted run's losses,
and resume from a checkpoint at the end of a round into the next one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from masklab import Mask, Schedule, save_mask
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
BASE = {"model": "llama-debug", "workers": 2, "steps": 6, "batch_size": 2, "seq_len": 32, "eval_batches": 1,
        "max_data_bytes": 100_000, "memory_steps": 0, "warmup_steps": 1, "seed": 5, "active": None,
        "min_lr_ratio": 1.0}  # one learning rate after warm-up, whatever --steps: runs of 6 and 8 steps agree
M = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])
# coverage (1, 2, 2, 1) in every round; worker 0 holds 3, 4, 2 blocks in turn
BLOCK_ROUNDS = [M, np.array([[1, 1, 1, 1], [0, 1, 1, 0]]), np.array([[0, 1, 1, 0], [1, 1, 1, 1]])]


def _neuron_rounds() -> list[np.ndarray]:
    """Per block of llama-debug's 4, its 8 neuron groups split between the 2 workers three ways."""
    splits = [[g % 2 == 0 for g in range(8)], [g < 6 for g in range(8)], [g < 1 for g in range(8)]]
    rounds = []
    for split in splits:
        first = np.tile(np.array(split, dtype=int), 4)
        rounds.append(np.stack([first, 1 - first]))
    return rounds


def _cfg(out: Path, name: str, **kw) -> dict:
    return {**BASE, **kw, "out": str(out / name)}


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch; the files it names written into `out`."""
    files = {
        "cyclic": save_mask(Mask(M, schedule=Schedule("cyclic", 2)), out / "cyclic.json"),
        "rotations": save_mask(Mask.sequence([M, M[::-1]], every=2), out / "rotations.json"),
        "blocks": save_mask(Mask.sequence(BLOCK_ROUNDS, every=2), out / "blocks.json"),
        "neurons": save_mask(Mask.sequence(_neuron_rounds(), every=2), out / "neurons.json"),
    }
    configs = [_cfg(out, "cyclic", mode="bsdp", mask=str(files["cyclic"])),
               _cfg(out, "rotations", mode="bsdp", mask=str(files["rotations"])),
               _cfg(out, "bbsdp-blocks", mode="bbsdp", mask=str(files["blocks"]), checkpoint_every=6)]
    for mode, file in (("bsdp", "blocks"), ("nsdp", "neurons")):
        configs.append(_cfg(out, f"{mode}-{file}", mode=mode, mask=str(files[file]), checkpoint_every=3))
        configs.append(_cfg(out, f"{mode}-{file}-resumed", mode=mode, mask=str(files[file]),
                            resume=str(out / f"{mode}-{file}" / "checkpoints" / "step_3")))
    # the 6-step runs end a round (the next, round 3, is round 0's mask again): nothing may move for it.
    # 5 steps move the same; a resume from step 6 with 8 steps moves to round 3 first, as 8 steps do
    for mode in ("bsdp", "bbsdp"):
        kw = {"mode": mode, "mask": str(files["blocks"])}
        configs += [_cfg(out, f"{mode}-blocks-5", steps=5, **kw), _cfg(out, f"{mode}-blocks-8", steps=8, **kw),
                    _cfg(out, f"{mode}-blocks-more", steps=8, **kw,
                         resume=str(out / f"{mode}-blocks" / "checkpoints" / "step_6"))]
    return "train", {"configs": configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return shared_out(tmp_path_factory, "test_sequence_schedule")


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def test_the_sequence_of_rotations_trains_exactly_the_cyclic_schedule(runs):
    cyclic, rotations = _metrics(runs / "cyclic"), _metrics(runs / "rotations")
    assert [(m["loss"], m["grad_norm"]) for m in rotations] == [(m["loss"], m["grad_norm"]) for m in cyclic]
    assert _summary(runs / "rotations")["final_val_loss"] == _summary(runs / "cyclic")["final_val_loss"]
    assert _summary(runs / "rotations")["mask_change_bytes"] == _summary(runs / "cyclic")["mask_change_bytes"] > 0


@pytest.mark.parametrize("name", ["bsdp-blocks", "nsdp-neurons"])
def test_a_sequence_resumed_mid_round_repeats_the_uninterrupted_run(runs, name):
    full, resumed = _metrics(runs / name), _metrics(runs / f"{name}-resumed")
    assert [m["step"] for m in resumed] == [3, 4, 5]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in full[3:]]
    assert _summary(runs / name)["final_val_loss"] == _summary(runs / f"{name}-resumed")["final_val_loss"]
    assert _summary(runs / name)["mask_change_bytes"] > 0


@pytest.mark.parametrize("mode", ["bsdp", "bbsdp"])
def test_nothing_moves_after_the_last_step(runs, mode):
    """A 6-step run ends round 2; round 3 never trains, so its blocks (B-SDP) or optimizer state
    (Bb-SDP) must not move: the run moves what a 5-step run moves (changes at steps 2 and 4)."""
    moved = _summary(runs / f"{mode}-blocks")["mask_change_bytes"]
    assert moved == _summary(runs / f"{mode}-blocks-5")["mask_change_bytes"] > 0


@pytest.mark.parametrize("mode", ["bsdp", "bbsdp"])
def test_a_run_resumed_from_its_final_checkpoint_with_more_steps_trains_the_next_round(runs, mode):
    """The checkpoint at step 6 holds round 2's state (no change was made after the last step); the
    run resumed from it with 8 steps moves to round 3 before step 6 and repeats the 8-step run."""
    full, more = _metrics(runs / f"{mode}-blocks-8"), _metrics(runs / f"{mode}-blocks-more")
    assert [m["step"] for m in more] == [6, 7]
    assert [(m["loss"], m["grad_norm"]) for m in more] == [(m["loss"], m["grad_norm"]) for m in full[6:]]
    summaries = {n: _summary(runs / f"{mode}-blocks{n}") for n in ("", "-8", "-more")}
    assert summaries["-more"]["final_val_loss"] == summaries["-8"]["final_val_loss"]
    assert summaries[""]["mask_change_bytes"] + summaries["-more"]["mask_change_bytes"] == \
        summaries["-8"]["mask_change_bytes"]


def test_backward_masking_trains_a_sequence_and_moves_optimizer_state(runs):
    summary = _summary(runs / "bbsdp-blocks")
    assert summary["mask_change_bytes"] > 0 and np.isfinite(summary["final_val_loss"])
    assert len(_metrics(runs / "bbsdp-blocks")) == BASE["steps"]


def test_a_checkpoint_of_another_sequence_is_refused(runs):
    other = save_mask(Mask.sequence(BLOCK_ROUNDS[:2], every=2), runs / "other.json")
    cfg = TrainConfig(**{**_cfg(runs, "x", mode="bsdp", mask=str(other)),
                         "resume": str(runs / "bsdp-blocks" / "checkpoints" / "step_3")})
    with pytest.raises(ConfigError, match="cannot resume from .*schedule: checkpoint"):
        prepare(cfg)


def test_a_sequence_round_that_breaks_n_sdp_is_refused_naming_it(tmp_path):
    rounds = _neuron_rounds()
    rounds[2][0, :8], rounds[2][1, :8] = 0, 1  # round 2: worker 0 keeps no neuron group of block 0
    path = save_mask(Mask.sequence(rounds, every=2), tmp_path / "m.json")
    with pytest.raises(ConfigError, match="row 0 of sequence round 2 holds none of block 0"):
        prepare(TrainConfig(**_cfg(tmp_path, "x", mode="nsdp", mask=str(path))))
