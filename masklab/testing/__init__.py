"""masklab.testing: property-testing tools for users' own SDP masks, schedules and models.

Strategies (Hypothesis) for masks, schedules, exact designs and problem constants; assertion
helpers for mask invariants; model-level checks of a user's ``torch.nn.Module`` and block map;
and a pytest plugin (`masklab.testing.plugin`). See docs/testing.md. This package needs the dev
dependency ``hypothesis``; `import masklab` never imports it, and torch is only imported by the
model-level checks when they run.
"""

from masklab.testing.asserts import (
    assert_covers,
    assert_masking_error_at_most,
    assert_spectral_gap_at_least,
    assert_valid_mask,
)
from masklab.testing.errors import BlockMapError
from masklab.testing.models import (
    assert_holder_average,
    assert_subnetwork_consistent,
    block_parts,
    from_sdp_train,
    zero_blocks,
)
from masklab.testing.strategies import (
    balanced_masks,
    block_designs,
    masks,
    problem_constants,
    schedules,
    step_sizes,
)

__all__ = [
    "BlockMapError",
    "assert_covers",
    "assert_holder_average",
    "assert_masking_error_at_most",
    "assert_spectral_gap_at_least",
    "assert_subnetwork_consistent",
    "assert_valid_mask",
    "balanced_masks",
    "block_designs",
    "block_parts",
    "from_sdp_train",
    "masks",
    "problem_constants",
    "schedules",
    "step_sizes",
    "zero_blocks",
]
