"""theory: convergence bounds for SDP masks, proved in docs/theory.md and checked by simulation.

`theory.bounds` evaluates the stepwise and local-step bounds (Theorems 1-3, 2'),
`theory.holder_sets` the holder-set gap of random holder sets, `theory.consensus` overlap averaging
with schedules (Theorems 4 and 6), `theory.constants` the worst split of totals and per-block
constants files, `theory.coverage` which theorem covers a run, `theory.problems` test problems with
known constants and `theory.simulate` runs SDP on them. Imports no torch.
"""
