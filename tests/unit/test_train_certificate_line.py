"""`sdp train`'s certificate line: properties of the mask, gamma's optimality ratio as a design figure."""

from __future__ import annotations

from masklab import Mask, analyze
from sdp_train.trainer.outputs import mask_lines


def test_certificate_line_prints_no_guarantee_and_labels_gamma_a_design_figure():
    mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    line = mask_lines(mask, analyze(mask))[-1]
    assert "not guarantees for this run" in line and "no theorem covers AdamW" in line
    ratio = line.index("optimality ratio")
    assert "a design figure: no stepwise theorem uses gamma" in line[ratio:]


def test_mask_lines_say_how_many_losses_the_mask_survives_and_that_recovery_is_not_built():
    mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    line = next(line for line in mask_lines(mask, analyze(mask)) if "redundancy" in line)
    assert "any 1 simultaneous worker loss (min coverage - 1)" in line
    assert "fatal: {0,1} {0,2} {1,2} (3 sets of 2 workers)" in line
    assert "continuing without rollback is not built" in line
