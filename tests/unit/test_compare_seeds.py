"""``sdp compare --seeds N`` plumbing: each seed's run has its own config (seed, directory) and the
same mask and steps, seed 0 keeps the one-seed layout, and resume-by-skip works per seed run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from masklab import Mask
from masklab.io import mask_to_dict
from sdp_train.compare.runner import Planned, RunSpec, compare, finished_summary, run_dir, seed_runs
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig


def _planned(out: Path) -> list[Planned]:
    mask = Mask(np.array([[1, 1, 0], [0, 1, 1]]))
    return [Planned(RunSpec("ddp", "ddp"), TrainConfig(mode="ddp", steps=4, out=str(run_dir(out, "ddp", 0))),
                    None, 1.0, None),
            Planned(RunSpec("bsdp", "bsdp", 0.5),
                    TrainConfig(mode="bsdp", steps=7, mask=str(out / "masks" / "bsdp.json"),
                                out=str(run_dir(out, "bsdp", 0))), mask, 0.5, None)]


def _finish(p: Planned) -> dict:
    """Write the summary.json `sdp train` would leave for `p`."""
    summary = {"config": p.config.to_dict(), "mask": None if p.mask is None else mask_to_dict(p.mask)}
    Path(p.config.out).mkdir(parents=True, exist_ok=True)
    (Path(p.config.out) / "summary.json").write_text(json.dumps(summary))
    return json.loads(json.dumps(summary))


def test_each_seed_gets_its_own_seed_and_directory_and_keeps_mask_and_steps(tmp_path):
    planned = _planned(tmp_path)
    assert seed_runs(planned, tmp_path, 0) == planned  # seed 0: the one-seed comparison's runs
    two = seed_runs(planned, tmp_path, 2)
    assert [p.config.seed for p in two] == [2, 2]
    assert [p.config.out for p in two] == [str(tmp_path / "runs" / "ddp" / "seed_2"),
                                           str(tmp_path / "runs" / "bsdp" / "seed_2")]
    for before, after in zip(planned, two):
        assert after.config.mask == before.config.mask and after.mask is before.mask  # not redesigned
        assert after.config.steps == before.config.steps and after.spec == before.spec
    assert planned[0].config.seed == 0  # the seed-0 plan is not changed in place


def test_resume_skips_per_seed_run(tmp_path):
    planned = _planned(tmp_path)
    seed0, seed1 = planned[1], seed_runs(planned, tmp_path, 1)[1]
    done = _finish(seed0)
    assert finished_summary(seed0) == done
    assert finished_summary(seed1) is None  # seed 1 has not run: its own directory has no summary
    # a summary in seed 1's directory recording seed 0's config (say, copied there) is not seed 1's run
    Path(seed1.config.out).mkdir(parents=True)
    Path(seed1.config.out, "summary.json").write_text(json.dumps(done))
    assert finished_summary(seed1) is None
    assert _finish(seed1) == finished_summary(seed1)  # its own finished run is skipped
    assert finished_summary(seed0) == done  # seed 1's run inside runs/bsdp leaves seed 0's alone


def test_seeds_must_be_a_positive_integer(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match=f"--seeds {bad!r} must be a positive integer"):
            compare("cpu-small", tmp_path / "never", seeds=bad)
    assert not (tmp_path / "never").exists()
