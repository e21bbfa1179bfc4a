"""Hypothesis strategies for the project's own tests: the public kit, `masklab.testing.strategies`."""

from masklab.testing.strategies import balanced_masks, block_designs, masks, problem_constants, schedules

__all__ = ["balanced_masks", "block_designs", "masks", "problem_constants", "schedules"]
