"""The certificate (`sdp design`, `sdp inspect`) says what gamma is for and names a theorem for every guarantee."""

from __future__ import annotations

import re

from masklab.report import USED_BY, analyze
from masklab.mask import Mask


def test_gamma_text_says_what_it_is_used_for_and_that_a_static_mask_does_not_mix():
    text = USED_BY["spectral_gap"]
    assert "overlap averaging only" in text
    assert "static mask" in text and "does not" in text  # gamma is no consensus rate of a static mask
    assert "redrawn every round" not in text or "permute" in text
    assert re.search(r"Theorem 4\.2", text)  # the only theorem where gamma is a rate


def test_every_certificate_line_names_a_theorem_or_says_it_is_a_diagnostic():
    for key, text in USED_BY.items():
        assert re.search(r"Theorems? \d|diagnostic|heuristic|estimate|FLOP matching", text), (key, text)
    lines = analyze(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])).to_text().splitlines()
    gamma = next(line for line in lines if line.startswith("spectral gap (gamma)"))
    assert "static mask" in gamma


def test_failures_survived_names_the_run_that_uses_them_not_a_plan():
    text = USED_BY["failures_survived"]
    assert "--on-worker-loss continue" in text and "not built" not in text, text
