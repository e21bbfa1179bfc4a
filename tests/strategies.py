"""Hypothesis strategies for the project's own tests: the public kit (`masklab.testing`, `theory.testing`)."""

from masklab.testing.strategies import balanced_masks, block_designs, masks, schedules
from theory.testing import problem_constants

__all__ = ["balanced_masks", "block_designs", "masks", "problem_constants", "schedules"]
