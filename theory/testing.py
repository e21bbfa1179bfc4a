"""Hypothesis strategies for the theory's problem constants and step sizes.

The property-testing kit for the bounds of docs/theory.md, beside `masklab.testing` (masks,
schedules, designs) and `sdp_train.testing` (model-level checks); see docs/testing.md. It needs
the dev dependency ``hypothesis``; ``import theory`` never imports this module. Strategies draw
values valid by construction (`ProblemConstants` validates them again); they check no bound.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from theory.bounds import ProblemConstants, max_step_size
from theory.errors import TheoryError

__all__ = ["problem_constants", "step_sizes"]


def problem_constants(
    *, blocks: int | st.SearchStrategy[int] | None = None, max_blocks: int = 10, max_value: float = 10.0,
    local_steps: bool = False,
) -> st.SearchStrategy[ProblemConstants]:
    """`ProblemConstants` with L in [0.01, max_value] and per-block sigma_j^2, zeta_j^2.

    Parameters
    ----------
    blocks : int or strategy of int, optional
        B, the length of ``sigma_sq`` / ``zeta_sq``; must equal the mask's B where both are used.
        Default: 1 to `max_blocks`.
    max_value : float
        Upper end of L, of each sigma_j and zeta_j, and of f(x_0) - f*.
    local_steps : bool
        Also draw the local-step constants (worker smoothness >= L, per-block G_j^2).

    Examples
    --------
    >>> from hypothesis import find
    >>> find(problem_constants(blocks=2), lambda c: True).sigma_sq.shape
    (2,)
    """
    if not (math.isfinite(max_value) and max_value >= 0.01):
        raise TheoryError(f"max_value={max_value!r} must be a finite number >= 0.01")
    return _problem_constants(_block_counts(blocks, max_blocks), max_value, local_steps)


def step_sizes(smoothness: float, *, local_steps: int = 1,
               min_fraction: float = 1e-3) -> st.SearchStrategy[float]:
    """Step sizes eta in [min_fraction * eta_max, eta_max], eta_max = `max_step_size` for L = `smoothness`.

    The floor keeps eta away from subnormal floats, for which the bound's 1/(eta T) term overflows.
    """
    if not 0.0 < min_fraction <= 1.0:
        raise TheoryError(f"min_fraction={min_fraction!r} must be in (0, 1]")
    eta_max = max_step_size(smoothness, local_steps=local_steps)
    return st.floats(min_fraction, 1.0).map(lambda f: f * eta_max)


def _block_counts(blocks: int | st.SearchStrategy[int] | None, max_blocks: int) -> st.SearchStrategy[int]:
    if isinstance(blocks, st.SearchStrategy):
        return blocks
    if blocks is None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise TheoryError(f"max_blocks={max_blocks!r} must be an integer >= 1")
        return st.integers(1, max_blocks)
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or blocks < 1:
        raise TheoryError(f"blocks={blocks!r} must be an integer >= 1 or a strategy of integers")
    return st.just(int(blocks))


@st.composite
def _problem_constants(draw, blocks_s, max_value: float, local_steps: bool) -> ProblemConstants:
    b = draw(blocks_s)
    positive = st.floats(0.01, max_value)
    per_block = st.lists(st.floats(0.0, max_value), min_size=b, max_size=b).map(lambda v: np.square(v))
    smoothness = draw(positive)
    extra = {}
    if local_steps:
        extra = {"worker_smoothness": smoothness * draw(st.floats(1.0, 4.0)), "grad_sq": draw(per_block)}
    return ProblemConstants(
        smoothness=smoothness, sigma_sq=draw(per_block), zeta_sq=draw(per_block),
        suboptimality=draw(positive), **extra,
    )
