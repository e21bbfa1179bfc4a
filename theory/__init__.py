"""theory: convergence conditions for SDP masks, proved in docs/theory.md and checked by simulation.

`theory.bounds` evaluates the bounds and step sizes for a `masklab.Mask`, `theory.consensus` the
consensus-deviation bound of overlap averaging, `theory.problems` builds test problems with known
constants and `theory.simulate` runs SDP on them. Imports no torch.
"""
