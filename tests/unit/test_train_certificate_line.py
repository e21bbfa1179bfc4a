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
