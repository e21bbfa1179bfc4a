"""A constants file's ``shared`` column: the parameters every worker holds, one more column of coverage K."""

from __future__ import annotations

import json

import numpy as np
import pytest

from masklab.mask import Mask, Schedule
from theory.bounds import sdp_bound
from theory.constants import load_constants, load_constants_file
from theory.errors import TheoryError

MASK = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], block_sizes=(4, 4, 4))


def _write(tmp_path, **fields):
    data = {"format": "sdp-constants", "version": 1, "sigma_sq": [0.1, 0.2, 0.3], "zeta_sq": [0.0, 0.5, 0.0],
            "smoothness": 2.0, "suboptimality": 3.0, **fields}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("schedule", [Schedule(), Schedule("permute", 1), Schedule("cyclic", 2)])
def test_shared_column_adds_ddp_noise_term_to_the_stepwise_bound(tmp_path, schedule):
    mask = MASK.replace(schedule=schedule)
    shared = _write(tmp_path, shared={"sigma_sq": 0.8, "zeta_sq": 0.4, "parameters": 10})
    loaded = load_constants_file(shared, mask)
    assert loaded.mask.coverage.tolist() == [3, 3, 3, 4] and loaded.mask.block_sizes == (4, 4, 4, 10)
    assert loaded.mask.block_names[-1] == "shared" and not loaded.estimated
    without = load_constants(_write(tmp_path), mask)
    eta, steps = 0.2, 50
    gap = (sdp_bound(loaded.mask, loaded.constants, eta=eta, steps=steps).total
           - sdp_bound(mask, without, eta=eta, steps=steps).total)
    # coverage K: no bias (eps = 0, kappa = 0) and noise L eta sigma^2 / K, DDP's (docs/theory.md §7)
    assert gap == pytest.approx(2.0 * eta * 0.8 / 4, rel=1e-9)


@pytest.mark.parametrize(("shared", "message"), [
    ({"sigma_sq": 1.0}, "'shared.zeta_sq' is required"),
    ({"sigma_sq": 1.0, "zeta_sq": -1}, "'shared.zeta_sq' must be a finite number >= 0"),
    ({"sigma_sq": 1.0, "zeta_sq": 0.0, "grad_sq": 1.0, "parameters": 3}, "'shared.grad_sq' is given but"),
    ({"sigma_sq": 1.0, "zeta_sq": 0.0}, "'shared.parameters' is required"),
    ({"sigma_sq": 1.0, "zeta_sq": 0.0, "parameters": 0}, "'shared.parameters' must be an integer >= 1"),
    ({"sigma_sq": 1.0, "zeta_sq": 0.0, "parameters": 3, "sigma": 1}, "unknown field 'shared.sigma'"),
    ([1.0], "field 'shared' must be a JSON object"),
])
def test_bad_shared_column_names_the_field(tmp_path, shared, message):
    with pytest.raises(TheoryError, match=message):
        load_constants_file(_write(tmp_path, shared=shared), MASK)


def test_estimate_object_marks_the_constants_estimated(tmp_path):
    loaded = load_constants_file(_write(tmp_path, estimate={"by": "sdp estimate"}), MASK)
    assert loaded.estimated and loaded.estimate == {"by": "sdp estimate"}
    np.testing.assert_allclose(loaded.constants.sigma_sq, [0.1, 0.2, 0.3])
