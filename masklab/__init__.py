"""masklab: SDP mask design, mask graphs and spectral analysis (numpy, scipy, networkx; no torch).

The main entry points::

    from masklab import Mask, Schedule, design, analyze, load_mask, save_mask

`Mask` validates a K x B 0/1 matrix; `analyze` returns its certificate (coverage, masking error,
variance inflation, spectral gap against the trace bound, co-training gap); `design` builds the
best mask for (K, B, C); `save_mask`/`load_mask` read and write versioned JSON.
"""

from masklab.design import design
from masklab.errors import DesignError, MaskError, MaskFileError
from masklab.io import load_mask, save_mask
from masklab.mask import Mask, Schedule
from masklab.report import MaskReport, analyze

__all__ = [
    "DesignError",
    "Mask",
    "MaskError",
    "MaskFileError",
    "MaskReport",
    "Schedule",
    "analyze",
    "design",
    "load_mask",
    "save_mask",
]
