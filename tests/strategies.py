"""Hypothesis strategies for the project's own tests: valid masks of small size."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from masklab.mask import Mask, Schedule


@st.composite
def masks(draw, *, max_workers: int = 8, max_blocks: int = 10, schedule: bool = False) -> Mask:
    """A valid mask: random 0/1 entries, then one holder forced into every empty column and row."""
    k = draw(st.integers(1, max_workers))
    b = draw(st.integers(1, max_blocks))
    bits = draw(st.lists(st.booleans(), min_size=k * b, max_size=k * b))
    m = np.array(bits, dtype=np.uint8).reshape(k, b)
    for j in np.flatnonzero(m.sum(axis=0) == 0):
        m[draw(st.integers(0, k - 1)), j] = 1
    for i in np.flatnonzero(m.sum(axis=1) == 0):
        m[i, draw(st.integers(0, b - 1))] = 1
    kind = draw(st.sampled_from(["static", "permute", "cyclic"])) if schedule else "static"
    return Mask(m, schedule=Schedule(kind, draw(st.integers(1, 5))))


@st.composite
def balanced_masks(draw, *, max_workers: int = 8, max_blocks: int = 10) -> Mask:
    """A mask in which every block has the same coverage c (rows non-empty)."""
    k = draw(st.integers(1, max_workers))
    b = draw(st.integers(1, max_blocks))
    c = draw(st.integers(max(1, -(-k // b)), k))
    order = draw(st.permutations(range(k)))
    m = np.zeros((k, b), dtype=np.uint8)
    # Column j takes c consecutive workers of a fixed permutation starting at j*c: every worker is
    # reached because b*c >= k, and each column has exactly c distinct holders.
    for j in range(b):
        for t in range(c):
            m[order[(j * c + t) % k], j] = 1
    return Mask(m)
