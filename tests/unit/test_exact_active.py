"""Every requested C is realised exactly or refused: ``sdp train --active 0.69 --workers 4`` trained
C = 0.75 under a warning; now a C that no c/K of the K workers realises within 0.005 is refused in
one line naming the nearest c/K and the K (and c) that realise it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.design import ACTIVE_TOLERANCE, exact_coverage
from masklab.errors import DesignError
from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig


def _realises(k: int, c: int, active: float) -> bool:
    return 1 <= c <= k and abs(c / k - active) <= ACTIVE_TOLERANCE


@settings(deadline=None, max_examples=200)
@given(K=st.integers(1, 64), active=st.floats(0.001, 1.0))
def test_coverage_is_within_tolerance_or_the_refusal_names_the_fewest_workers_that_realise_it(K, active):
    try:
        c = exact_coverage(K, active)
    except DesignError as exc:
        message = str(exc)
        assert not any(_realises(K, c, active) for c in range(1, K + 1))
        named = [(int(k), int(c)) for k, c in re.findall(r"K = (\d+) \(c = (\d+)\)", message)]
        assert named and all(_realises(k, c, active) for k, c in named), message
        fewest = named[0][0]
        assert not any(_realises(k, c, active) for k in range(1, fewest) for c in range(1, k + 1)), message
        if len(named) > 1:
            assert named[1][0] % K == 0 and named[1][0] > fewest
        nearest = [int(c) for c in re.findall(r"with c = (\d+)", message)]
        assert nearest and all(abs(c - active * K) < 1 for c in nearest), message
    else:
        assert _realises(K, c, active)


def test_the_papers_c_values_need_their_worker_counts():
    assert exact_coverage(16, 0.69) == 11 and exact_coverage(8, 0.375) == 3 and exact_coverage(16, 0.375) == 6
    with pytest.raises(DesignError, match=r"it needs K = 8 \(c = 3\)$"):
        exact_coverage(4, 0.375)


@pytest.mark.parametrize(("workers", "active", "mode"), [(4, 0.69, "bsdp"), (3, 0.5, "nsdp"), (1, 0.5, "bbsdp")])
def test_sdp_train_refuses_a_c_its_workers_cannot_realise_in_one_line(tmp_path, capsys, workers, active, mode):
    argv = ["train", "--model", "llama-debug", "--mode", mode, "--workers", str(workers), "--active", str(active),
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sdp train: error: active={active:g} (--active) with "
                                               f"workers={workers} (--workers): C = {active:g} is not c/K"), err
    assert not (tmp_path / "run").exists()


def test_a_mask_file_or_a_baseline_is_not_held_to_active():
    TrainConfig(mode="ddp", workers=3)  # the default active=0.5 means nothing without a mask
    TrainConfig(mode="bsdp", workers=3, active=None, mask="m.json")
    assert TrainConfig(mode="bsdp", workers=16, active=0.69).active == 0.69
    with pytest.raises(ConfigError, match="K = 13 \\(c = 9\\), or with a multiple of 4 workers K = 16 \\(c = 11\\)"):
        TrainConfig(mode="overlap", workers=4, active=0.69)


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_the_library_refuses_a_c_the_ranks_cannot_realise_instead_of_rounding_it(level):
    """``SubnetworkDataParallel(active=)`` and ``OverlapAveraging(active=)`` (both `resolve_mask`)
    designed C = 0.75 for ``active=0.69`` on 4 ranks; now the C is refused as ``sdp train`` refuses it."""
    from torch import nn

    from sdp_train.parallel.masking import describe
    from sdp_train.parallel.parts import resolve_mask

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    model = nn.Sequential(*(Block() for _ in range(4)))
    blocks = [str(i) for i in range(4)]
    layout = describe(model, blocks, level, **({"neuron_groups": 4} if level == "neuron" else {}))
    with pytest.raises(ConfigError, match=r"^active=0\.69: C = 0\.69 is not c/K .* K = 16 \(c = 11\)$"):
        resolve_mask(None, 0.69, 4, layout, seed=0)
    mask = resolve_mask(None, 0.75, 4, layout, seed=0)
    assert mask.active_fraction == 0.75
    assert resolve_mask(None, 0.6875, 16, layout, seed=0).active_fraction == pytest.approx(11 / 16)
