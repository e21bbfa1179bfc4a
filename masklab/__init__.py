"""masklab: SDP mask design, mask graphs and spectral analysis (numpy, scipy, networkx; no torch).

The main entry points::

    from masklab import Mask, Schedule, design, analyze, load_mask, save_mask

`Mask` validates a K x B 0/1 matrix; `analyze` returns its certificate (coverage, masking error,
variance inflation, spectral gap against the trace bound, co-training gap); `design` builds the
best mask for (K, B, C); `design_for_costs` one that balances the blocks' bytes (`BlockCosts`)
and fits each worker's memory budget; `save_mask`/`load_mask` and `save_costs`/`load_costs` read
and write versioned JSON.
"""

from masklab.balance import design_for_costs
from masklab.costs import BlockCosts
from masklab.design import design
from masklab.errors import CostsFileError, DesignError, MaskError, MaskFileError
from masklab.io import load_costs, load_mask, save_costs, save_mask
from masklab.mask import Mask, Schedule
from masklab.neurons import neuron_design
from masklab.report import MaskReport, analyze

__all__ = [
    "BlockCosts",
    "CostsFileError",
    "DesignError",
    "Mask",
    "MaskError",
    "MaskFileError",
    "MaskReport",
    "Schedule",
    "analyze",
    "design",
    "design_for_costs",
    "load_costs",
    "load_mask",
    "neuron_design",
    "save_costs",
    "save_mask",
]
