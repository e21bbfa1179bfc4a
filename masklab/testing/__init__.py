"""masklab.testing: property-testing tools for users' own SDP masks and schedules.

Strategies (Hypothesis) for masks, schedules and exact designs; assertion helpers for mask
invariants; and a pytest plugin (`masklab.testing.plugin`). See docs/testing.md, which also
covers the kit's other halves: `theory.testing` (problem constants and step sizes) and
`sdp_train.testing` (model-level checks of a user's ``torch.nn.Module``), which live with the
packages they need, since masklab imports nothing above itself. This package needs the dev
dependency ``hypothesis``; `import masklab` never imports it.
"""

from masklab.testing.asserts import (
    assert_covers,
    assert_masking_error_at_most,
    assert_spectral_gap_at_least,
    assert_valid_mask,
)
from masklab.testing.strategies import (
    balanced_masks,
    block_designs,
    mask_sequences,
    masks,
    schedules,
)

__all__ = [
    "assert_covers",
    "assert_masking_error_at_most",
    "assert_spectral_gap_at_least",
    "assert_valid_mask",
    "balanced_masks",
    "block_designs",
    "mask_sequences",
    "masks",
    "schedules",
]
